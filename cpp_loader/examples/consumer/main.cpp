// A minimal serving binary: load an embserve artifact and run one lookup (one id per bag, batch 2).
#include <embserve/loader.h>

#include <ATen/ATen.h>  // tensors only: a serving binary needs no torch::nn (torch/torch.h doubles the compile)

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: my_server ARTIFACT\n";
    return 2;
  }
  try {
    embserve::Model model = embserve::Model::load(argv[1]);
    const int64_t batch = 2;
    const auto num_features = static_cast<int64_t>(model.features().size());
    at::Tensor lengths = at::ones({num_features * batch}, at::kInt);  // feature-major
    at::Tensor values = at::arange(num_features * batch, at::kLong) % 7;
    at::Tensor pooled = model.lookup(values, lengths);
    std::cout << "features:";
    for (const auto& name : model.feature_names()) std::cout << " " << name;
    std::cout << "\noutput [" << pooled.size(0) << ", " << pooled.size(1) << "] sum " << pooled.sum().item<double>()
              << "\n";
    return 0;
  } catch (const embserve::Error& err) {
    std::cerr << "embserve: " << err.what() << "\n";
    return 1;
  }
}
