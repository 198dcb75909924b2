// The call contract through the library API: a valid request (batch 2, one id 0 per bag, unit weights, zero dense
// features) with one tensor cast to each dtype in turn, through lookup and predict. Prints one line per call,
//   <method> <tensor> <dtype> ok
//   <method> <tensor> <dtype> <ErrorType>: <message>
// and one line saying whether an undefined weights tensor answers as absent weights do. The test that runs it
// (tests/cpp/test_cpp_contract.py) decides, from its own table, which dtypes must pass and which be refused.
// Usage: embserve_contract_check ARTIFACT [torchscript|pt2]. Exits 0 unless the model cannot be loaded.
#include <embserve/loader.h>

#include <torch/types.h>

#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace {

const std::vector<std::pair<std::string, at::ScalarType>> kDtypes = {
    {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16},
    {"int64", at::kLong},    {"int32", at::kInt},      {"int16", at::kShort},  {"int8", at::kChar},
    {"uint8", at::kByte},    {"bool", at::kBool},
};

struct Call {
  at::Tensor values, lengths, weights, dense;
};

std::string kind_of(const std::exception& err) {
  if (dynamic_cast<const embserve::RequestError*>(&err)) return "RequestError";
  if (dynamic_cast<const embserve::ModelError*>(&err)) return "ModelError";
  if (dynamic_cast<const embserve::Error*>(&err)) return "Error";
  return "OtherError";
}

std::string outcome(const embserve::Model& model, const std::string& method, const Call& call) {
  try {
    if (method == "predict")
      model.predict(call.dense, call.values, call.lengths, call.weights);
    else
      model.lookup(call.values, call.lengths, call.weights);
    return "ok";
  } catch (const std::exception& err) {
    std::string text = err.what();
    for (char& c : text)
      if (c == '\n') c = ' ';
    return kind_of(err) + ": " + text;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: embserve_contract_check ARTIFACT [torchscript|pt2]\n";
    return 2;
  }
  try {
    embserve::LoadOptions options;
    if (argc > 2 && std::string(argv[2]) == "pt2") options.backend = embserve::Backend::Pt2;
    const embserve::Model model = embserve::Model::load(argv[1], options);
    const int64_t batch = 2, num_features = static_cast<int64_t>(model.features().size());
    const Call good{torch::zeros({num_features * batch}, torch::kInt64), torch::ones({num_features * batch}, torch::kInt32),
                    torch::ones({num_features * batch}, torch::kFloat),
                    torch::zeros({batch, std::max<int64_t>(1, model.num_dense_features())}, torch::kFloat)};
    std::vector<std::string> methods = {"lookup"};
    if (model.has_dense()) methods.push_back("predict");
    for (const auto& method : methods) {
      for (const std::string tensor : {"values", "lengths", "weights", "dense_features"}) {
        if (tensor == "dense_features" && method != "predict") continue;
        for (const auto& [name, dtype] : kDtypes) {
          Call call = good;
          at::Tensor& target = tensor == "values"    ? call.values
                               : tensor == "lengths" ? call.lengths
                               : tensor == "weights" ? call.weights
                                                     : call.dense;
          target = target.to(dtype);
          std::cout << method << " " << tensor << " " << name << " " << outcome(model, method, call) << "\n";
        }
      }
      const auto run = [&](const std::optional<at::Tensor>& weights) {
        return method == "predict" ? model.predict(good.dense, good.values, good.lengths, weights)
                                   : model.lookup(good.values, good.lengths, weights);
      };
      std::cout << method << " undefined_weights_as_absent "
                << (torch::equal(run(at::Tensor()), run(std::nullopt)) ? "same" : "differ") << "\n";
    }
    return 0;
  } catch (const std::exception& err) {
    std::cerr << "error: " << err.what() << "\n";
    return 1;
  }
}
