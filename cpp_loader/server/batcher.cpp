#include "batcher.h"

#include <algorithm>
#include <cstring>
#include <iostream>

namespace embserve::server {
namespace {
using Clock = std::chrono::steady_clock;
// a request waits for company while callers overlapped within this long (or two batching delays, if longer)
constexpr double kConcurrencyMemoryS = 1.0;

double seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

int64_t nanoseconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count();
}

// the merged batch of several requests (model order), in buffers of its own
struct Merged {
  std::vector<int64_t> ids64;
  std::vector<int32_t> ids32;
  std::vector<int64_t> lengths64;
  std::vector<int32_t> lengths32;
  std::vector<float> weights;
  std::vector<float> dense;
};

template <typename T>
void append(std::vector<T>& out, const Array& array) {
  for (int64_t i = 0; i < array.count; ++i) out.push_back(static_cast<T>(array.at(i)));
}

const void* nonnull(const void* data) {
  static const int64_t empty = 0;  // from_blob of zero elements still wants a pointer
  return data != nullptr ? data : &empty;
}
}  // namespace

Batcher::Batcher(const Runner& runner, Forward forward, const ModelShape& shape, BatcherSettings settings,
                 BatchObserver* observer, std::function<int64_t()> arriving, ExecutionObserver on_execution)
    : runner_(runner),
      forward_(forward),
      shape_(shape),
      settings_(settings),
      merge_limit_(std::min(settings.max_batch_size, settings.max_merge_examples)),
      observer_(observer),
      arriving_(std::move(arriving)),
      on_execution_(std::move(on_execution)),
      concurrent_at_(Clock::now() - std::chrono::hours(1)) {
  for (int i = 0; i < std::max(1, settings.workers); ++i) threads_.emplace_back([this] { consume(); });
}

Batcher::~Batcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (auto& t : threads_) t.join();
}

bool Batcher::submit(Call* call) {
  call->enqueued = Clock::now();
  // a lone caller (nothing queued or running here, no other call arriving, no overlap lately) is served on the
  // calling thread: no batch could form, and two thread hand-offs per call cost more CPU than the forward of a
  // small request (the Python server hands every request to a forward thread)
  const bool alone = !settings_.always_wait && (!arriving_ || arriving_() <= 1);
  if (alone) {
    std::unique_lock<std::mutex> lock(mutex_);
    const double memory = std::max(kConcurrencyMemoryS, 2 * settings_.max_delay_s);
    if (queue_.empty() && held_ == 0 && seconds(concurrent_at_, call->enqueued) >= memory) {
      ++held_;
      lock.unlock();
      forward({call}, Clock::now());
      return true;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.size() >= settings_.max_queue) return false;
    queue_.push_back(call);
    ++held_;
    if (held_ > 1) concurrent_at_ = call->enqueued;
  }
  changed_.notify_one();
  return true;
}

void Batcher::run_now(Call* call) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++held_;
  }
  forward({call}, Clock::now());
}

void Batcher::flush() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    flushing_ = true;
  }
  changed_.notify_all();
}

size_t Batcher::depth() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size();
}

int64_t Batcher::held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_;
}

bool Batcher::expecting_more() const {
  if (flushing_) return false;
  const double memory = std::max(kConcurrencyMemoryS, 2 * settings_.max_delay_s);
  if (settings_.always_wait || !arriving_ || seconds(concurrent_at_, Clock::now()) < memory) return true;
  return arriving_() > 0;
}

std::vector<Call*> Batcher::gather(std::unique_lock<std::mutex>& lock) {
  changed_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
  std::vector<Call*> calls;
  if (queue_.empty()) return calls;
  calls.push_back(queue_.front());
  queue_.pop_front();
  int64_t size = calls[0]->request->batch;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(settings_.max_delay_s));
  while (size < merge_limit_) {
    if (queue_.empty()) {
      if (Clock::now() >= deadline || stopping_) break;
      // arriving_ reads other batchers' counts: never while holding this one's lock in a way that can cycle
      lock.unlock();
      const bool more = expecting_more();
      lock.lock();
      if (!more) break;
      changed_.wait_until(lock, deadline, [this] { return stopping_ || flushing_ || !queue_.empty(); });
      if (queue_.empty()) break;
    }
    Call* next = queue_.front();
    if (size + next->request->batch > merge_limit_) break;  // it goes first into the next batch
    queue_.pop_front();
    calls.push_back(next);
    size += next->request->batch;
  }
  return calls;
}

void Batcher::consume() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    std::vector<Call*> calls = gather(lock);
    if (calls.empty()) {
      if (stopping_) return;
      continue;
    }
    lock.unlock();
    const auto gathered = Clock::now();
    if (observer_ != nullptr)
      for (Call* call : calls) observer_->stage("queue", seconds(call->enqueued, gathered));
    forward(calls, gathered);
    lock.lock();
  }
}

void Batcher::forward(const std::vector<Call*>& calls, Clock::time_point gathered) {
  const auto started = Clock::now();
  Merged merged;
  SparseBatch batch;
  std::vector<Destination> destinations;
  int64_t rows = 0;
  for (Call* call : calls) {
    Destination d;
    d.row_start = rows;
    d.rows = call->request->batch;
    d.embeddings = call->embeddings;
    d.embeddings_fp16 = call->embeddings_fp16;
    d.scores = call->scores;
    destinations.push_back(d);
    rows += call->request->batch;
  }
  const bool dense = forward_ != Forward::Lookup;
  const int64_t num_dense = shape_.num_dense_features;
  if (calls.size() == 1 && calls[0]->request->contiguous) {
    batch = calls[0]->request->whole;
    batch.dense = calls[0]->request->dense;
  } else {
    bool wide_ids = false, wide_lengths = false, weighted = false;
    int64_t num_ids = 0;
    for (Call* call : calls) {
      weighted = weighted || call->request->weighted;
      for (const auto& f : call->request->features) {
        wide_ids = wide_ids || f.ids.width == 8;
        wide_lengths = wide_lengths || f.lengths.width == 8;
        num_ids += f.ids.count;
      }
    }
    if (wide_ids) merged.ids64.reserve(static_cast<size_t>(num_ids));
    else merged.ids32.reserve(static_cast<size_t>(num_ids));
    if (weighted) merged.weights.reserve(static_cast<size_t>(num_ids));
    for (size_t f = 0; f < shape_.features.size(); ++f) {
      for (Call* call : calls) {
        const FeatureSlice& slice = call->request->features[f];
        if (wide_ids) append(merged.ids64, slice.ids);
        else append(merged.ids32, slice.ids);
        if (wide_lengths) append(merged.lengths64, slice.lengths);
        else append(merged.lengths32, slice.lengths);
        if (weighted) {
          if (slice.weights != nullptr)
            merged.weights.insert(merged.weights.end(), slice.weights, slice.weights + slice.ids.count);
          else
            merged.weights.insert(merged.weights.end(), static_cast<size_t>(slice.ids.count), 1.0f);
        }
      }
    }
    if (dense)
      for (Call* call : calls)
        merged.dense.insert(merged.dense.end(), call->request->dense, call->request->dense + call->request->batch * num_dense);
    batch.ids = wide_ids ? static_cast<const void*>(merged.ids64.data()) : merged.ids32.data();
    batch.id_width = wide_ids ? 8 : 4;
    batch.num_ids = num_ids;
    batch.lengths = wide_lengths ? static_cast<const void*>(merged.lengths64.data()) : merged.lengths32.data();
    batch.length_width = wide_lengths ? 8 : 4;
    batch.num_lengths = rows * static_cast<int64_t>(shape_.features.size());
    batch.weights = weighted ? merged.weights.data() : nullptr;
    batch.dense = dense ? merged.dense.data() : nullptr;
  }
  batch.batch = rows;
  batch.ids = nonnull(batch.ids);
  batch.lengths = nonnull(batch.lengths);
  if (dense) batch.dense = static_cast<const float*>(nonnull(batch.dense));
  const auto ready = Clock::now();
  Outcome outcome = Outcome::Ok;
  std::string message;
  try {
    runner_.run(forward_, batch, destinations);
  } catch (const RunnerRequestError& err) {
    outcome = Outcome::BadRequest;
    message = err.what();
  } catch (const std::exception& err) {
    outcome = Outcome::Internal;
    message = err.what();
  }
  const auto ran = Clock::now();
  if (observer_ != nullptr) {
    observer_->batch(static_cast<int>(calls.size()), rows);
    observer_->stage("merge", seconds(started, ready));
    observer_->stage("lookup", seconds(ready, ran));
    observer_->stage("split", 0.0);  // the rows were written into each response by the forward itself
  }
  StageTimes stages;
  stages.merge_ns = nanoseconds(started, ready);
  stages.forward_ns = nanoseconds(ready, ran);
  if (outcome == Outcome::Ok && on_execution_) on_execution_(rows, stages);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    held_ -= static_cast<int64_t>(calls.size());
  }
  stages.answered = Clock::now();
  for (Call* call : calls) {
    call->timing = stages;
    call->timing.queue_ns = std::max<int64_t>(0, nanoseconds(call->enqueued, gathered));
    call->done(outcome, message);
  }
}

}  // namespace embserve::server
