// The prefetcher (prefetch.h): Python's Prefetcher step for step, on plain pointers.
#include "prefetch.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <map>
#include <memory>

namespace embserve::prefetch {
namespace {
constexpr size_t kMinRunsPerTask = 64;  // prefetch.MIN_RUNS_PER_TASK

uint64_t page_size() {
  static const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// every id of a feature with a table, with its table: ask(table, row)
template <typename Id, typename Length, typename Ask>
void collect(const Id* ids, const Length* lengths, int64_t num_features, int64_t batch,
             const std::vector<int64_t>& table_of_feature, Ask&& ask) {
  int64_t at = 0;
  for (int64_t f = 0; f < num_features; ++f) {
    int64_t count = 0;
    for (int64_t b = 0; b < batch; ++b) count += static_cast<int64_t>(lengths[f * batch + b]);
    const int64_t t = table_of_feature[static_cast<size_t>(f)];
    if (t >= 0)
      for (int64_t i = at; i < at + count; ++i) ask(static_cast<size_t>(t), static_cast<uint64_t>(ids[i]));
    at += count;
  }
}
}  // namespace

Prefetcher::Prefetcher(std::vector<Region> regions, int threads, int forget_after)
    : forget_after_(forget_after), threads_(std::max(1, threads)) {
  std::map<const unsigned char*, int64_t> seen;
  for (const auto& region : regions) {
    if (region.address == nullptr || region.rows <= 0) {
      table_of_feature_.push_back(-1);
      continue;
    }
    auto found = seen.find(region.address);
    if (found == seen.end()) {
      Table table;
      table.address = region.address;
      table.row_bytes = region.row_bytes;
      table.rows = region.rows;
      const auto begin = reinterpret_cast<uintptr_t>(region.address);
      table.first_page = begin / page_size();
      const uint64_t last_page = (begin + static_cast<uint64_t>(region.rows * region.row_bytes) - 1) / page_size();
      table.asked.assign(last_page - table.first_page + 1, 0);
      found = seen.emplace(region.address, static_cast<int64_t>(tables_.size())).first;
      tables_.push_back(std::move(table));
    }
    table_of_feature_.push_back(found->second);
  }
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(pool_mutex_);
    stopping_ = true;
  }
  pool_wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void Prefetcher::advise_random() const {
  for (const auto& table : tables_) {
    const uint64_t start = table.first_page * page_size();
    const auto end = reinterpret_cast<uintptr_t>(table.address) + static_cast<uint64_t>(table.rows * table.row_bytes);
    (void)madvise(reinterpret_cast<void*>(start), end - start, MADV_RANDOM);  // advice only changes speed
  }
}

void Prefetcher::run_pool() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(pool_mutex_);
      pool_wake_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (stopping_ && tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void Prefetcher::advise_runs(const std::vector<std::pair<uint64_t, uint64_t>>& runs, size_t begin, size_t end) const {
  const uint64_t page = page_size();
  for (size_t i = begin; i < end; ++i)  // an error only costs the read ahead: the fault reads the page
    (void)madvise(reinterpret_cast<void*>(runs[i].first * page), (runs[i].second - runs[i].first) * page,
                  MADV_WILLNEED);
}

int64_t Prefetcher::prefetch(const at::Tensor& values, const at::Tensor& lengths) {
  const auto num_features = static_cast<int64_t>(table_of_feature_.size());
  if (num_features == 0 || values.numel() == 0) return 0;
  const int64_t batch = lengths.numel() / num_features;
  const at::Tensor ids = values.contiguous(), bags = lengths.contiguous();
  std::vector<uint64_t> pages;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (++batches_ > forget_after_) {
      for (auto& table : tables_) std::fill(table.asked.begin(), table.asked.end(), 0);
      batches_ = 1;
    }
    const uint64_t page = page_size();
    auto ask = [&](size_t t, uint64_t row) {
      Table& table = tables_[t];
      const auto begin = reinterpret_cast<uintptr_t>(table.address) + row * static_cast<uint64_t>(table.row_bytes);
      const uint64_t first = begin / page, last = (begin + static_cast<uint64_t>(table.row_bytes) - 1) / page;
      for (uint64_t p = first; p <= last; ++p) {
        uint8_t& asked = table.asked[p - table.first_page];
        if (!asked) {
          asked = 1;
          pages.push_back(p);
        }
      }
    };
    const bool long_ids = ids.scalar_type() == at::kLong, long_lengths = bags.scalar_type() == at::kLong;
    if (long_ids && long_lengths)
      collect(ids.data_ptr<int64_t>(), bags.data_ptr<int64_t>(), num_features, batch, table_of_feature_, ask);
    else if (long_ids)
      collect(ids.data_ptr<int64_t>(), bags.data_ptr<int32_t>(), num_features, batch, table_of_feature_, ask);
    else if (long_lengths)
      collect(ids.data_ptr<int32_t>(), bags.data_ptr<int64_t>(), num_features, batch, table_of_feature_, ask);
    else
      collect(ids.data_ptr<int32_t>(), bags.data_ptr<int32_t>(), num_features, batch, table_of_feature_, ask);
  }
  if (pages.empty()) return 0;
  std::sort(pages.begin(), pages.end());
  // one madvise per run of consecutive pages: [first, end)
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (const uint64_t p : pages) {
    if (!runs.empty() && runs.back().second == p)
      runs.back().second = p + 1;
    else
      runs.emplace_back(p, p + 1);
  }
  const size_t tasks = std::min(static_cast<size_t>(threads_), std::max<size_t>(1, runs.size() / kMinRunsPerTask));
  if (tasks == 1) {
    advise_runs(runs, 0, runs.size());
  } else {
    {
      std::lock_guard<std::mutex> lock(pool_mutex_);
      while (workers_.size() < static_cast<size_t>(threads_)) workers_.emplace_back([this] { run_pool(); });
    }
    const size_t step = (runs.size() + tasks - 1) / tasks;
    std::vector<std::future<void>> done;
    for (size_t begin = 0; begin < runs.size(); begin += step) {
      auto task = std::make_shared<std::packaged_task<void()>>(
          [this, &runs, begin, step] { advise_runs(runs, begin, std::min(runs.size(), begin + step)); });
      done.push_back(task->get_future());
      {
        std::lock_guard<std::mutex> lock(pool_mutex_);
        tasks_.emplace_back([task] { (*task)(); });
      }
      pool_wake_.notify_one();
    }
    for (auto& future : done) future.wait();
  }
  return static_cast<int64_t>(pages.size());
}

}  // namespace embserve::prefetch
