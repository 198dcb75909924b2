// The source of embserve_torch_pch (cpp_loader/CMakeLists.txt): it only carries <torch/torch.h>'s precompiled
// header, which embserve_run, the checks and the server's runner reuse.
