// Two (or more) threads share one embserve::Model; every thread's outputs must equal a single-thread
// reference computed first. Usage: embserve_thread_test ARTIFACT [THREADS] [ITERATIONS] [torchscript|pt2]
// With pt2 the threads share a Pt2-backend model and the reference comes from the TorchScript backend loaded
// in the same process.
// A model with a dense part also runs predict on every other call, against a single-thread predict of the same
// model (same backend) computed first.
// Prints "ok ..." and exits 0 on success; exits 1 naming the first mismatch otherwise.
#include <embserve/loader.h>

#include <torch/types.h>
#include <torch/utils.h>

#include <atomic>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: embserve_thread_test ARTIFACT [THREADS] [ITERATIONS]\n";
    return 2;
  }
  const int num_threads = argc > 2 ? std::stoi(argv[2]) : 2;
  const int iterations = argc > 3 ? std::stoi(argv[3]) : 50;
  const bool pt2 = argc > 4 && std::string(argv[4]) == "pt2";
  try {
    embserve::LoadOptions options;
    if (pt2) options.backend = embserve::Backend::Pt2;
    embserve::Model model = embserve::Model::load(argv[1], options);
    const embserve::Model reference_model = pt2 ? embserve::Model::load(argv[1]) : model;
    const auto& features = model.features();
    const int64_t num_features = static_cast<int64_t>(features.size());
    torch::manual_seed(0);
    struct Req {
      at::Tensor values, lengths, weights, dense;
    };
    std::vector<Req> requests;
    for (int r = 0; r < 16; ++r) {
      const int64_t batch = 1 + r % 7;
      at::Tensor lengths = torch::randint(0, 6, {num_features * batch}, torch::kInt32);
      std::vector<at::Tensor> ids;
      for (int64_t f = 0; f < num_features; ++f) {
        int64_t n = lengths.slice(0, f * batch, (f + 1) * batch).sum().item<int64_t>();
        ids.push_back(torch::randint(0, features[static_cast<size_t>(f)].num_embeddings, {n}, torch::kInt64));
      }
      at::Tensor values = torch::cat(ids);
      if (r % 2) values = values.to(torch::kInt32);
      at::Tensor dense = model.has_dense() ? torch::randn({batch, model.num_dense_features()}) : at::Tensor();
      requests.push_back({values, lengths, r % 3 == 0 ? torch::rand({values.numel()}) : at::Tensor(), dense});
    }
    auto call_on = [&](const embserve::Model& on, const Req& q) {
      return on.lookup(q.values, q.lengths, q.weights.defined() ? std::optional<at::Tensor>(q.weights) : std::nullopt);
    };
    auto call = [&](const Req& q) { return call_on(model, q); };
    auto predict = [&](const Req& q) {
      return model.predict(q.dense, q.values, q.lengths,
                           q.weights.defined() ? std::optional<at::Tensor>(q.weights) : std::nullopt);
    };
    std::vector<at::Tensor> reference, reference_scores;
    for (const auto& q : requests) reference.push_back(call_on(reference_model, q));
    if (model.has_dense())
      for (const auto& q : requests) reference_scores.push_back(predict(q));

    std::atomic<int> mismatches{0};
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < num_threads; ++t) {
      threads.emplace_back([&, t] {
        try {
          for (int i = 0; i < iterations; ++i) {
            size_t k = static_cast<size_t>(i + t * 5) % requests.size();
            if (model.has_dense() && i % 2 == 1) {
              if (!torch::equal(predict(requests[k]), reference_scores[k])) ++mismatches;
            } else if (!torch::equal(call(requests[k]), reference[k])) {
              ++mismatches;
            }
          }
        } catch (const std::exception& err) {
          std::cerr << "thread " << t << ": " << err.what() << "\n";
          ++failures;
        }
      });
    }
    for (auto& thread : threads) thread.join();
    if (mismatches || failures) {
      std::cerr << "FAILED: " << mismatches << " mismatches, " << failures << " failed threads\n";
      return 1;
    }
    std::cout << "ok " << num_threads << " threads x " << iterations << " lookups match the reference"
              << (pt2 ? " (pt2 backend vs torchscript)" : "")
              << (model.has_dense() ? "; predicts match a single-thread predict" : "") << "\n";
    return 0;
  } catch (const std::exception& err) {
    std::cerr << "error: " << err.what() << "\n";
    return 1;
  }
}
