// Dynamic batching across concurrent calls (server/batcher.py's rules, in plain C++): a bounded queue of
// validated requests; forward threads each take the first, wait up to max_delay for company only while callers
// overlap (or --batch-wait always), merge up to max_merge_examples, run one forward and write every call's rows
// straight into its response buffer.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "request.h"
#include "runner.h"

namespace embserve::server {

// How a forward ended for one call: ok, a bad request (the loader's words) or an internal failure.
enum class Outcome { Ok, BadRequest, Internal };

// The stages of the forward that served one call (Triton's statistics extension), in nanoseconds.
struct StageTimes {
  int64_t queue_ns = 0;    // from submit until a forward thread took it (0 for a lone caller run at once)
  int64_t merge_ns = 0;    // its forward's inputs merged
  int64_t forward_ns = 0;  // its forward (rows written into the responses included)
  int64_t split_ns = 0;    // its forward's outputs split back (0: the forward wrote them in place)
  std::chrono::steady_clock::time_point answered;  // when `done` was called
};

// What a batcher reports of each forward that ran: its examples and stages (queue_ns unused).
using ExecutionObserver = std::function<void(int64_t examples, const StageTimes& stages)>;

// One accepted model call waiting for its rows.
struct Call {
  Request* request = nullptr;
  void* embeddings = nullptr;  // where its embeddings go (float32 or fp16 rows), or null
  bool embeddings_fp16 = false;
  float* scores = nullptr;  // where its scores go, or null
  std::function<void(Outcome, const std::string&)> done;  // on a forward thread, once the rows are written
  std::chrono::steady_clock::time_point enqueued;
  StageTimes timing;  // filled in before `done`
};

// What the batcher reports (metrics.h implements it).
class BatchObserver {
 public:
  virtual ~BatchObserver() = default;
  virtual void batch(int requests, int64_t examples) = 0;
  virtual void stage(const char* stage, double seconds) = 0;
};

struct BatcherSettings {
  int64_t max_batch_size = 4096;
  int64_t max_merge_examples = 1024;
  double max_delay_s = 0.001;
  size_t max_queue = 1024;
  int workers = 1;
  bool always_wait = false;
};

class Batcher {
 public:
  // arriving(): calls accepted but not yet queued in any batcher (the overlap rule's second half);
  // on_execution: told of every forward that ran (the statistics extension), or empty
  Batcher(const Runner& runner, Forward forward, const ModelShape& shape, BatcherSettings settings,
          BatchObserver* observer, std::function<int64_t()> arriving, ExecutionObserver on_execution = {});
  ~Batcher();
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queue a call; false when the queue is full (RESOURCE_EXHAUSTED: the caller answers it).
  bool submit(Call* call);
  // Run one request now on the calling thread, bypassing the queue (warm-up).
  void run_now(Call* call);
  // Stop waiting for company (the drain began): every batch runs at once from now on.
  void flush();
  size_t depth() const;
  int64_t held() const;  // submitted and not yet answered

 private:
  void consume();
  std::vector<Call*> gather(std::unique_lock<std::mutex>& lock);
  bool expecting_more() const;
  void forward(const std::vector<Call*>& calls, std::chrono::steady_clock::time_point gathered);

  const Runner& runner_;
  const Forward forward_;
  const ModelShape& shape_;
  const BatcherSettings settings_;
  const int64_t merge_limit_;
  BatchObserver* observer_;
  std::function<int64_t()> arriving_;
  ExecutionObserver on_execution_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Call*> queue_;
  int64_t held_ = 0;
  std::chrono::steady_clock::time_point concurrent_at_;
  bool flushing_ = false;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace embserve::server
