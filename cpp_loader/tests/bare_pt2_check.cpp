// What a C++ user gets who loads a mapped artifact's model.pt2 as torch documents
// (torch::inductor::AOTIModelPackageLoader) and runs it with the documented inputs (batch 1, id 0 in every bag),
// after loading fbgemm's operator libraries: tests/cpp/test_cpp_pt2.py expects it to throw in embserve's words
// (no embserve loader hands the package its tables). Built with the loader's tools, so the suite compiles it once.
#include <dlfcn.h>

#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

int main(int argc, char** argv) {  // model.pt2 num_features fbgemm_library...
  for (int i = 3; i < argc; ++i)
    if (dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL) == nullptr) return 2;
  const int64_t features = std::stoll(argv[2]);
  try {
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    const auto outputs = loader.run({at::zeros({features}, at::kLong), at::ones({features}, at::kLong),
                                     at::ones({features}, at::kFloat)});
    std::cout << "returned, NaN: " << outputs[0].isnan().any().item<bool>() << std::endl;
    return 0;
  } catch (const std::exception& err) {
    std::cout << "threw: " << err.what() << std::endl;
    return 1;
  }
}
