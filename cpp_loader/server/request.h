// Requests as the model takes them: decoded views over the request's bytes, validated with the rules and the
// words of infer/request_rules.py (SparseFeatures.validate, the v1 and OIP codecs), in plain C++ (no torch, no
// protobuf). Every size and offset is checked before anything is read.
#pragma once

#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

#include "runner.h"

namespace embserve::server {

// A refusal in Python's words: INVALID_ARGUMENT (reason "invalid").
class BadRequest : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A typed little-endian array read in place (or from the request's owned storage).
struct Array {
  const void* data = nullptr;
  int width = 8;  // bytes per element
  int64_t count = 0;
  int64_t at(int64_t i) const {  // an integer element (width 4 or 8)
    if (width == 8) return static_cast<const int64_t*>(data)[i];
    return static_cast<const int32_t*>(data)[i];
  }
};

// One feature of a validated request, in place.
struct FeatureSlice {
  Array ids;
  Array lengths;                   // one per example
  const float* weights = nullptr;  // one per id, or null
};

// A validated request in the model's feature order.
struct Request {
  int64_t batch = 0;
  std::vector<FeatureSlice> features;
  const float* dense = nullptr;  // [batch, num_dense], or null
  bool weighted = false;
  // set when the request's ids/lengths/weights already lie in model order, one block each: run as it is
  bool contiguous = false;
  SparseBatch whole;
  // what the request's own bytes could not give in place (converted, realigned), owned here
  std::deque<std::vector<char>> storage;

  // An aligned copy of `size` bytes when `data` is not aligned to `width`, else `data` itself.
  const void* aligned(const void* data, int64_t size, int width);
};

// infer/request_rules.py's words and limits
std::string clip(const std::string& text, size_t limit = 64);
std::string clip_names(const std::vector<std::string>& names, size_t count = 5);
std::string py_repr(const std::string& text);  // Python's repr() of a str
std::string py_list(const std::vector<std::string>& names);  // Python's repr() of a list of str
std::string bounded(const std::string& message);  // at most MAX_MESSAGE_CHARS (1024)
std::string too_large(int64_t batch, int64_t max_batch);
// infer.request_rules.uneven_batch and bags_differ, word for word
std::string uneven_batch(int64_t entries, const std::vector<std::string>& names);
std::string bags_differ(const std::string& feature, int64_t bags, const std::string& first, int64_t first_bags);

// A request-order batch in the concatenated feature-major layout (v1 packed and typed, OIP once concatenated):
// checked with SparseFeatures' rules (constructor, then validate) and laid out in model order.
void validate_concatenated(const std::vector<std::string>& keys, Array ids, Array lengths, const float* weights,
                           int64_t num_weights, const ModelShape& shape, Request& request);

}  // namespace embserve::server
