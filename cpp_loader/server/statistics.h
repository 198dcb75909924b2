// Triton's statistics extension for the one served model (server/statistics.py's VersionStatistics, in plain
// C++): what the Open Inference Protocol's ModelInfer answered or refused on the model, and every batched forward
// of its batchers (embserve.v1 calls share them, as in the Python server's single-artifact mode; warm-up
// forwards run on the runner directly and are not counted). Updated from the completion-queue and forward
// threads, so every access holds the lock (a few adds per call).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>

namespace embserve::server {

// How many times, and how long in all (Triton's StatisticDuration).
struct Duration {
  uint64_t count = 0;
  uint64_t ns = 0;
  void add(int64_t nanoseconds, uint64_t times = 1) {
    count += times;
    ns += static_cast<uint64_t>(nanoseconds > 0 ? nanoseconds : 0);
  }
};

struct BatchDurations {
  Duration compute_input, compute_infer, compute_output;
};

struct StatisticsSnapshot {
  Duration success, fail, queue, compute_input, compute_infer, compute_output;
  uint64_t inference_count = 0;  // examples of successful requests
  uint64_t execution_count = 0;  // batched forwards
  uint64_t last_inference_ms = 0;  // ms since the epoch of the last successful request (0: none yet)
  std::map<int64_t, BatchDurations> batches;  // by the forward's examples, in order
};

class Statistics {
 public:
  // One answered request of `examples` examples: `total_ns` from arrival to its answer; its stages.
  void request_succeeded(int64_t examples, int64_t total_ns, int64_t queue_ns, int64_t input_ns, int64_t infer_ns,
                         int64_t output_ns) {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    std::lock_guard<std::mutex> lock(mutex_);
    counters_.success.add(total_ns);
    counters_.queue.add(queue_ns);
    counters_.compute_input.add(input_ns);
    counters_.compute_infer.add(infer_ns);
    counters_.compute_output.add(output_ns);
    counters_.inference_count += static_cast<uint64_t>(examples);
    counters_.last_inference_ms =
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(now).count());
  }

  // One request that named this model and got no outputs (refused or failed).
  void request_failed(int64_t total_ns) {
    std::lock_guard<std::mutex> lock(mutex_);
    counters_.fail.add(total_ns);
  }

  // One batched forward of `examples` examples that ran (a failed forward is not an execution).
  void execution(int64_t examples, int64_t merge_ns, int64_t forward_ns, int64_t split_ns) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++counters_.execution_count;
    BatchDurations& batch = counters_.batches[examples];
    batch.compute_input.add(merge_ns);
    batch.compute_infer.add(forward_ns);
    batch.compute_output.add(split_ns);
  }

  StatisticsSnapshot snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return counters_;
  }

 private:
  mutable std::mutex mutex_;
  StatisticsSnapshot counters_;
};

}  // namespace embserve::server
