// The hot-row cache of a mapped model, as Python's infer/artifact/paged.py HotRowCache computes it: the chosen rows
// of the mapped tables copied into one small resident table (fbgemm's row codec, its own lookup op), a batch's ids
// split once between it and the model, the cache's SUM pools added into the model's columns in Python's order, so
// the outputs equal Python's bit for bit. The rows' pages in the mapping are let go after the copy (MADV_DONTNEED):
// RAM holds the hot rows, not the 4 KiB pages around them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "embserve/loader.h"

namespace torch::jit {
struct Module;
}

namespace embserve::hot_rows {

class HotRowCache {
 public:
  // `tbe`: the model's one CPU kernel over every feature (its weights mapped); `features`: the model's features.
  // Throws ConfigError (an unknown table, a row outside its table, no rows) or ModelError (a kernel this cache
  // cannot read rows from). `where`: the model file, for messages.
  HotRowCache(const torch::jit::Module& tbe, const std::vector<FeatureInfo>& features, const HotRows& hot,
              const std::string& where);

  // A batch's ids split between the model (cold) and the cache (hot, as slots of the cache's table).
  struct Split {
    at::Tensor cold_values, cold_lengths;
    std::optional<at::Tensor> cold_weights;
    at::Tensor slots, hot_lengths;  // hot_lengths: the cached features' bags only, feature-major
    std::optional<at::Tensor> hot_weights;
  };
  // HotRowCache.split of a validated batch (values int64/int32, lengths int32/int64, feature-major).
  Split split(const at::Tensor& values, const at::Tensor& lengths, const std::optional<at::Tensor>& weights) const;
  // HotRowCache.add: the cache's pooled rows added into the model's output `out` of split's cold part.
  void add(at::Tensor& out, const at::Tensor& lengths, const Split& split) const;

  int64_t rows() const { return rows_; }
  int64_t tables() const { return static_cast<int64_t>(tables_.size()); }
  int64_t bytes() const { return weights_.numel(); }

 private:
  struct Table {
    std::string name;
    std::vector<int64_t> rows;  // sorted, distinct
    int64_t offset = 0;         // in weights_
  };
  struct Feature {
    int64_t feature = 0;  // in the model
    size_t table = 0;     // in tables_
    bool mean = false;
    int64_t column_start = 0, dim = 0;
  };
  int64_t num_features_ = 0;
  std::vector<Table> tables_;
  std::vector<Feature> cached_;            // the features whose table is cached, in model order
  std::vector<int64_t> table_of_feature_;  // model feature -> index in tables_, or -1
  at::Tensor weights_;                     // the cache's rows (uint8), tables 128-byte aligned
  int64_t rows_ = 0;
  c10::OperatorHandle op_;
  std::vector<c10::IValue> head_;  // the op's arguments before indices
  at::Tensor no_cache_weights_, no_cache_locations_;
};

}  // namespace embserve::hot_rows
