// Reading a batch's pages of mapped tables ahead of the kernel, as Python's infer/storage/prefetch.py Prefetcher:
// the pages a batch's ids will touch are asked of the kernel (madvise MADV_WILLNEED: asynchronous reads, many in
// flight, spread over a pool of threads) before the lookup runs, so its page faults find them read or reading
// instead of each waiting for one synchronous read. The mappings are advised MADV_RANDOM first: a fault reads its
// own page, not a readahead window around it (which, under a RAM budget, evicts the pages the next ids need).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>

namespace embserve::prefetch {

// Where one feature's rows lie: row r at address + r * row_bytes, rows [0, rows).
struct Region {
  const unsigned char* address = nullptr;
  int64_t row_bytes = 0;
  int64_t rows = 0;
};

class Prefetcher {
 public:
  // `regions`: per model feature (features of one table share its region's bookkeeping); `threads`: the pool's size.
  Prefetcher(std::vector<Region> regions, int threads = 16, int forget_after = 64);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // MADV_RANDOM on every region.
  void advise_random() const;
  // Ask for every page a validated batch (feature-major ids, lengths per feature and bag) reads that was not asked
  // for in the last `forget_after` batches; returns once all are asked for (not read). Returns the pages asked for.
  int64_t prefetch(const at::Tensor& values, const at::Tensor& lengths);

 private:
  struct Table {
    const unsigned char* address = nullptr;
    int64_t row_bytes = 0, rows = 0;
    uint64_t first_page = 0;
    std::vector<uint8_t> asked;  // per page of the table since the last reset
  };
  std::vector<Table> tables_;
  std::vector<int64_t> table_of_feature_;
  int forget_after_;
  int batches_ = 0;
  std::mutex mutex_;  // the asked pages and the batch count (forwards run on several threads)
  // the pool issuing the madvise calls
  void run_pool();
  void advise_runs(const std::vector<std::pair<uint64_t, uint64_t>>& runs, size_t begin, size_t end) const;
  int threads_;
  std::vector<std::thread> workers_;
  std::mutex pool_mutex_;
  std::condition_variable pool_wake_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
};

}  // namespace embserve::prefetch
