// The hot-row cache (hot_rows.h): Python's HotRowCache (infer/artifact/paged.py) step for step, so that a server
// with the same rows answers the same floats.
#include "hot_rows.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/types.h>

namespace embserve::hot_rows {
namespace {

constexpr int64_t kTableAlignment = 128;  // the TBE places every table on a 128-byte boundary (rowwise.TABLE_ALIGNMENT)
constexpr int64_t kFillRows = 16384;      // rows copied per piece at load (paged.FILL_ROWS)
constexpr int64_t kHostPlacement = 3;     // fbgemm EmbeddingLocation.HOST

// fbgemm SparseType codes and the row bytes of each (infer/quant/rowwise.py unpadded_row_bytes)
enum SparseType : int64_t { kFp32 = 0, kFp16 = 1, kInt8 = 2, kInt4 = 3, kInt2 = 4 };

int64_t unpadded_row_bytes(int64_t dim, int64_t type) {
  switch (type) {
    case kFp32: return dim * 4;
    case kFp16: return dim * 2;
    case kInt8: return dim + 4;
    case kInt4: return dim / 2 + 4;
    case kInt2: return dim / 4 + 4;
    default: return -1;
  }
}

int64_t round_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

int64_t int_attr(const torch::jit::Module& m, const char* name) {
  const c10::IValue v = m.attr(name);
  if (v.isEnum()) return v.toEnumHolder()->value().toInt();
  return v.toInt();
}

// madvise over the pages that cover [address, address + length); advice only changes speed, so a failure is ignored
void advise(const unsigned char* address, int64_t length, int advice) {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<uintptr_t>(address) / page * page;
  const auto end = reinterpret_cast<uintptr_t>(address) + static_cast<uintptr_t>(length);
  if (length > 0) (void)madvise(reinterpret_cast<void*>(first), end - first, advice);
}

// The pages of `rows` (sorted) of a table at `base`, asked for ahead of the copy: one MADV_WILLNEED per run of pages
// (a copy faulting one page at a time would read at the disk's depth-1 rate).
void ask_for_rows(const unsigned char* base, int64_t row_bytes, const int64_t* rows, int64_t count) {
  static const auto page = static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  const auto origin = static_cast<int64_t>(reinterpret_cast<uintptr_t>(base));
  int64_t run_first = -1, run_last = -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t first = (origin + rows[i] * row_bytes) / page, last = (origin + (rows[i] + 1) * row_bytes - 1) / page;
    if (run_first >= 0 && first <= run_last + 1) {
      run_last = std::max(run_last, last);
      continue;
    }
    if (run_first >= 0)
      (void)madvise(reinterpret_cast<void*>(run_first * page), (run_last - run_first + 1) * page, MADV_WILLNEED);
    run_first = first;
    run_last = last;
  }
  if (run_first >= 0)
    (void)madvise(reinterpret_cast<void*>(run_first * page), (run_last - run_first + 1) * page, MADV_WILLNEED);
}

}  // namespace

HotRowCache::HotRowCache(const torch::jit::Module& tbe, const std::vector<FeatureInfo>& features, const HotRows& hot,
                         const std::string& where)
    : num_features_(static_cast<int64_t>(features.size())),
      op_(c10::Dispatcher::singleton().findSchemaOrThrow("fbgemm::int_nbit_split_embedding_codegen_lookup_function",
                                                         "")) {
  c10::InferenceMode guard;
  // the rows asked for, per table: checked against the table, sorted and made distinct (torch.unique)
  std::map<std::string, int64_t> table_rows;
  for (const auto& f : features) table_rows.emplace(f.table, f.num_embeddings);
  std::map<std::string, std::vector<int64_t>> wanted;
  for (const auto& [name, ids] : hot) {
    const auto found = table_rows.find(name);
    if (found == table_rows.end()) {
      std::string names;
      for (const auto& [table, rows] : table_rows) names += (names.empty() ? "" : ", ") + ("'" + table + "'");
      throw ConfigError("hot_rows names table '" + name + "', which the model does not have; its tables are [" +
                        names + "]");
    }
    for (const int64_t id : ids)
      if (id < 0 || id >= found->second)
        throw ConfigError("hot_rows of table '" + name + "' has row " + std::to_string(id) + ", outside [0, " +
                          std::to_string(found->second) + "); pass rows of that table");
    auto& rows = wanted[name];
    rows.insert(rows.end(), ids.begin(), ids.end());
  }
  for (auto& [name, rows] : wanted) {
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  }

  // where every feature's table lies in the kernel: the TBE's per-feature offsets, types and widths
  const at::Tensor host = tbe.attr("weights_host").toTensor();
  const at::Tensor offsets = tbe.attr("weights_offsets").toTensor().to(at::kLong).contiguous();
  const at::Tensor types = tbe.attr("weights_tys").toTensor().to(at::kLong).contiguous();
  const at::Tensor d_offsets = tbe.attr("D_offsets").toTensor().to(at::kLong).contiguous();
  const int64_t alignment = int_attr(tbe, "row_alignment");
  if (offsets.numel() != num_features_ || d_offsets.numel() != num_features_ + 1 || host.scalar_type() != at::kByte)
    throw ModelError(where + ": hot_rows need a kernel over every feature of the model; this one has " +
                     std::to_string(offsets.numel()) + " of " + std::to_string(num_features_));
  table_of_feature_.assign(features.size(), -1);
  std::vector<int64_t> row_bytes;  // per cached table: the cache's (unpadded) row width
  for (int64_t f = 0; f < num_features_; ++f) {
    const auto& info = features[static_cast<size_t>(f)];
    auto rows = wanted.find(info.table);
    if (rows == wanted.end() || rows->second.empty()) continue;
    const int64_t type = types[f].item<int64_t>();
    const int64_t dim = d_offsets[f + 1].item<int64_t>() - d_offsets[f].item<int64_t>();
    const int64_t width = unpadded_row_bytes(dim, type);
    if (width < 0)
      throw ConfigError("hot_rows: table '" + info.table + "' is stored as fbgemm type " + std::to_string(type) +
                        "; the cache holds FP32, FP16, INT8, INT4 and INT2 tables: leave it out of the hot rows");
    if (dim != info.embedding_dim)
      throw ConfigError("hot_rows: table '" + info.table + "' is not held whole-width in the kernel (column-wise " +
                        "shards); cache only tables that are not split by columns");
    size_t slot = 0;
    while (slot < tables_.size() && tables_[slot].name != info.table) ++slot;
    if (slot == tables_.size()) {
      const int64_t stride = round_up(width, std::max<int64_t>(1, alignment));
      const int64_t start = offsets[f].item<int64_t>();
      if (start < 0 || start + info.num_embeddings * stride > host.numel())
        throw ModelError(where + ": table '" + info.table + "' lies outside its kernel's weights");
      tables_.push_back({info.table, rows->second, 0});
      row_bytes.push_back(width);
      rows_ += static_cast<int64_t>(rows->second.size());
    }
    table_of_feature_[static_cast<size_t>(f)] = static_cast<int64_t>(slot);
    cached_.push_back({f, slot, info.pooling == "mean", info.column_start, dim});
  }
  if (tables_.empty()) throw ConfigError("hot_rows names no rows; pass at least one table with rows to cache");

  // the cache's table: each table's rows at a 128-byte boundary, rows unpadded (the CPU row alignment, 1)
  int64_t total = 0;
  for (size_t t = 0; t < tables_.size(); ++t) {
    tables_[t].offset = total;
    total += round_up(static_cast<int64_t>(tables_[t].rows.size()) * row_bytes[t], kTableAlignment);
  }
  weights_ = at::zeros({total}, at::TensorOptions().dtype(at::kByte));
  auto* target = weights_.data_ptr<uint8_t>();
  const auto* source = host.data_ptr<uint8_t>();
  for (size_t t = 0; t < tables_.size(); ++t) {
    const auto& table = tables_[t];
    const auto first = std::find_if(cached_.begin(), cached_.end(), [&](const Feature& c) { return c.table == t; });
    const int64_t f = first->feature;
    const int64_t stride = round_up(row_bytes[t], std::max<int64_t>(1, alignment));
    const unsigned char* base = source + offsets[f].item<int64_t>();
    const auto count = static_cast<int64_t>(table.rows.size());
    for (int64_t piece = 0; piece < count; piece += kFillRows) {
      const int64_t end = std::min(count, piece + kFillRows);
      ask_for_rows(base, stride, table.rows.data() + piece, end - piece);
      for (int64_t i = piece; i < end; ++i)
        std::memcpy(target + table.offset + i * row_bytes[t], base + table.rows[static_cast<size_t>(i)] * stride,
                    static_cast<size_t>(row_bytes[t]));
    }
    // the copy mapped the hot rows' pages into this process: unmap them (they stay in the page cache, reclaimable
    // like any page the kernel does not read), so they do not count as resident here
    advise(base, features[static_cast<size_t>(f)].num_embeddings * stride, MADV_DONTNEED);
  }

  // the cache's kernel arguments, per cached feature, as fbgemm's TBE holds them (make_tbe: HOST, SUM, fp32 output)
  const auto count = static_cast<int64_t>(cached_.size());
  at::Tensor placements = at::full({count}, kHostPlacement, at::TensorOptions().dtype(at::kInt));
  at::Tensor table_offsets = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  at::Tensor cache_types = at::empty({count}, at::TensorOptions().dtype(at::kByte));
  at::Tensor cache_d_offsets = at::zeros({count + 1}, at::TensorOptions().dtype(at::kInt));
  std::map<int64_t, int64_t> max_d;  // per type
  int64_t total_d = 0;
  for (int64_t i = 0; i < count; ++i) {
    const auto& c = cached_[static_cast<size_t>(i)];
    const int64_t type = types[c.feature].item<int64_t>();
    table_offsets[i] = tables_[c.table].offset;
    cache_types[i] = type;
    total_d += c.dim;
    cache_d_offsets[i + 1] = total_d;
    max_d[type] = std::max(max_d[type], c.dim);
  }
  head_ = {weights_,
           at::empty({0}, at::TensorOptions().dtype(at::kByte)),
           placements,
           table_offsets,
           cache_types,
           cache_d_offsets,
           total_d,
           max_d[kInt2],
           max_d[kInt4],
           max_d[kInt8],
           max_d[kFp16],
           max_d[kFp32]};
  no_cache_weights_ = at::empty({0, 0}, at::TensorOptions().dtype(at::kByte));
  no_cache_locations_ = at::empty({0}, at::TensorOptions().dtype(at::kInt));
}

namespace {
template <typename Id, typename Length, typename Out>
void split_ids(const Id* ids, const Length* lengths, const float* weights, int64_t num_features, int64_t batch,
               const std::vector<int64_t>& table_of_feature, const std::vector<const std::vector<int64_t>*>& hot,
               Out& out) {
  int64_t at = 0;
  for (int64_t f = 0; f < num_features; ++f) {
    const int64_t slot = table_of_feature[static_cast<size_t>(f)];
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t bag = f * batch + b;
      const auto length = static_cast<int64_t>(lengths[bag]);
      Length hits = 0;
      for (int64_t i = at; i < at + length; ++i) {
        bool hit = false;
        if (slot >= 0) {
          const auto& rows = *hot[static_cast<size_t>(slot)];
          const auto found = std::lower_bound(rows.begin(), rows.end(), static_cast<int64_t>(ids[i]));
          if (found != rows.end() && *found == static_cast<int64_t>(ids[i])) {
            hit = true;
            out.slots.push_back(found - rows.begin());
            if (weights) out.hot_weights.push_back(weights[i]);
          }
        }
        if (!hit) {
          out.cold_values.push_back(ids[i]);
          if (weights) out.cold_weights.push_back(weights[i]);
        }
        hits += hit ? 1 : 0;
      }
      out.cold_lengths.push_back(static_cast<Length>(length - hits));
      if (slot >= 0) out.hot_lengths.push_back(hits);
      at += length;
    }
  }
}

template <typename Id, typename Length>
struct Pieces {
  std::vector<Id> cold_values;
  std::vector<Length> cold_lengths, hot_lengths;
  std::vector<int64_t> slots;
  std::vector<float> cold_weights, hot_weights;
};

template <typename T>
at::Tensor tensor_of(std::vector<T>& values, at::ScalarType type) {
  auto owner = std::make_shared<std::vector<T>>(std::move(values));
  auto* data = owner->data();
  const auto size = static_cast<int64_t>(owner->size());
  return at::from_blob(data, {size}, [owner](void*) {}, at::TensorOptions().dtype(type));
}

template <typename Id, typename Length>
HotRowCache::Split split_typed(const at::Tensor& values, const at::Tensor& lengths,
                               const std::optional<at::Tensor>& weights, int64_t num_features,
                               const std::vector<int64_t>& table_of_feature,
                               const std::vector<const std::vector<int64_t>*>& hot) {
  Pieces<Id, Length> out;
  const at::Tensor ids = values.contiguous(), bags = lengths.contiguous();
  const bool weighted = weights.has_value() && weights->defined();
  const at::Tensor w = weighted ? weights->contiguous() : at::Tensor();
  out.cold_values.reserve(static_cast<size_t>(ids.numel()));
  out.cold_lengths.reserve(static_cast<size_t>(bags.numel()));
  const int64_t batch = num_features > 0 ? bags.numel() / num_features : 0;
  split_ids(ids.data_ptr<Id>(), bags.data_ptr<Length>(), weighted ? w.data_ptr<float>() : nullptr, num_features,
            batch, table_of_feature, hot, out);
  const auto length_type = lengths.scalar_type();
  HotRowCache::Split split;
  split.cold_values = tensor_of(out.cold_values, values.scalar_type());
  split.cold_lengths = tensor_of(out.cold_lengths, length_type);
  split.slots = tensor_of(out.slots, at::kLong);
  split.hot_lengths = tensor_of(out.hot_lengths, length_type);
  if (weighted) {
    split.cold_weights = tensor_of(out.cold_weights, at::kFloat);
    split.hot_weights = tensor_of(out.hot_weights, at::kFloat);
  }
  return split;
}
}  // namespace

HotRowCache::Split HotRowCache::split(const at::Tensor& values, const at::Tensor& lengths,
                                      const std::optional<at::Tensor>& weights) const {
  std::vector<const std::vector<int64_t>*> hot;
  for (const auto& table : tables_) hot.push_back(&table.rows);
  const bool long_ids = values.scalar_type() == at::kLong, long_lengths = lengths.scalar_type() == at::kLong;
  if (long_ids && long_lengths)
    return split_typed<int64_t, int64_t>(values, lengths, weights, num_features_, table_of_feature_, hot);
  if (long_ids) return split_typed<int64_t, int32_t>(values, lengths, weights, num_features_, table_of_feature_, hot);
  if (long_lengths)
    return split_typed<int32_t, int64_t>(values, lengths, weights, num_features_, table_of_feature_, hot);
  return split_typed<int32_t, int32_t>(values, lengths, weights, num_features_, table_of_feature_, hot);
}

void HotRowCache::add(at::Tensor& out, const at::Tensor& lengths, const Split& split) const {
  if (split.slots.numel() == 0) return;
  c10::InferenceMode guard;
  // bag_offsets(cache_lengths, slots): [0, cumsum] in the slots' dtype
  at::Tensor offsets = at::zeros({split.hot_lengths.numel() + 1}, split.slots.options());
  offsets.slice(0, 1).copy_(at::cumsum(split.hot_lengths, 0).to(split.slots.scalar_type()));
  torch::jit::Stack stack(head_);
  stack.reserve(23);
  stack.emplace_back(split.slots);
  stack.emplace_back(offsets);
  stack.emplace_back(int64_t{0});  // PoolingMode.SUM
  stack.emplace_back(split.hot_weights ? c10::IValue(*split.hot_weights) : c10::IValue());
  stack.emplace_back(int64_t{0});  // SparseType.FP32 output
  stack.emplace_back(no_cache_weights_);
  stack.emplace_back(no_cache_locations_);
  stack.emplace_back(int64_t{1});   // row_alignment: the CPU's
  stack.emplace_back(int64_t{0});   // max_float8_D
  stack.emplace_back(int64_t{-1});  // fp8_exponent_bits
  stack.emplace_back(int64_t{-1});  // fp8_exponent_bias
  op_.callBoxed(&stack);
  const at::Tensor pooled = stack.back().toTensor();
  const int64_t batch = out.size(0);
  const at::Tensor full = lengths.view({num_features_, batch});
  const at::Tensor cold = split.cold_lengths.view({num_features_, batch});
  int64_t column = 0;
  for (const auto& c : cached_) {
    const at::Tensor hot_sum = pooled.slice(1, column, column + c.dim);
    at::Tensor target = out.slice(1, c.column_start, c.column_start + c.dim);
    if (c.mean) {
      const at::Tensor total = target * cold[c.feature].unsqueeze(1).to(out.scalar_type()) + hot_sum;
      target.copy_(total / full[c.feature].clamp_min(1).unsqueeze(1).to(out.scalar_type()));
    } else {
      target.add_(hot_sum);
    }
    column += c.dim;
  }
}

}  // namespace embserve::hot_rows
