// SparseFeatures' checks (infer/features.py) and infer/request_rules.py's wording, in plain C++.
#include "request.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <unordered_map>

namespace embserve::server {

const void* Request::aligned(const void* data, int64_t size, int width) {
  if (data == nullptr || size == 0 || reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(width) == 0)
    return data;
  storage.emplace_back(static_cast<size_t>(size));
  // a vector's buffer comes from operator new: aligned for every scalar type
  std::memcpy(storage.back().data(), data, static_cast<size_t>(size));
  return storage.back().data();
}

namespace {
size_t code_points(const std::string& text) {
  size_t n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}
// the first `limit` code points of text
std::string prefix(const std::string& text, size_t limit) {
  size_t n = 0, i = 0;
  for (; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) {
      if (n == limit) break;
      ++n;
    }
  }
  return text.substr(0, i);
}
}  // namespace

std::string clip(const std::string& text, size_t limit) {
  const size_t n = code_points(text);
  if (n <= limit) return text;
  return prefix(text, limit) + "\xE2\x80\xA6(" + std::to_string(n) + " chars)";
}

std::string clip_names(const std::vector<std::string>& names, size_t count) {
  std::string out = "[";
  for (size_t i = 0; i < names.size() && i < count; ++i) out += (i ? ", '" : "'") + clip(names[i]) + "'";
  out += "]";
  if (names.size() > count) out += " and " + std::to_string(names.size() - count) + " more";
  return out;
}

std::string py_repr(const std::string& text) {
  const bool single = text.find('\'') != std::string::npos, dbl = text.find('"') != std::string::npos;
  const char quote = single && !dbl ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == static_cast<unsigned char>(quote)) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + quote;
}

std::string py_list(const std::vector<std::string>& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + py_repr(names[i]);
  return out + "]";
}

std::string bounded(const std::string& message) { return clip(message, 1024); }

// infer.request_rules.too_large, word for word
std::string too_large(int64_t batch, int64_t max_batch) {
  const std::string limit = std::to_string(max_batch);
  return "batch of " + std::to_string(batch) + " examples exceeds the server's max batch size " + limit +
         " (embserve serve --max-batch-size " + limit + "); split the request into calls of at most " + limit +
         " examples (EmbserveClient does: it reads the limit from the model's metadata), or serve with a larger "
         "--max-batch-size";
}

// infer.request_rules.uneven_batch (with feature_list), word for word
std::string uneven_batch(int64_t entries, const std::vector<std::string>& names) {
  std::string listed = "[";
  for (size_t i = 0; i < std::min<size_t>(names.size(), 5); ++i) listed += (i ? ", '" : "'") + names[i] + "'";
  listed += "]";
  if (names.size() > 5) listed += " and " + std::to_string(names.size() - 5) + " more";
  const std::string count = std::to_string(names.size());
  return "lengths has " + std::to_string(entries) + " entries, not a multiple of the " + count + " features " +
         listed + ": it holds one bag length per example and feature (batch size x " + count +
         " entries, feature-major), so the features have inconsistent batch sizes";
}

// infer.request_rules.bags_differ, word for word
std::string bags_differ(const std::string& feature, int64_t bags, const std::string& first, int64_t first_bags) {
  return "feature '" + feature + "' has " + std::to_string(bags) + " bags but feature '" + first + "' has " +
         std::to_string(first_bags) +
         ": the features have inconsistent batch sizes; every feature needs one bag per example (an empty bag for "
         "no ids)";
}

namespace {

std::string weights_count(int64_t given, int64_t num_ids) {
  return "weights has " + std::to_string(given) + " entries but there are " + std::to_string(num_ids) +
         " ids; give one weight per id";
}

// SparseFeatures._first_feature_past: which feature's bags first reach past `available` ids (or weights)
std::string first_feature_past(const std::vector<std::string>& keys, Array lengths, int64_t num_ids,
                               int64_t available, const char* what) {
  const int64_t num_features = static_cast<int64_t>(keys.size());
  if (!num_features || lengths.count % num_features || lengths.count > (int64_t{1} << 24)) return "";
  for (int64_t i = 0; i < lengths.count; ++i)
    if (lengths.at(i) < 0 || lengths.at(i) > num_ids) return "";
  const int64_t batch = lengths.count / num_features;
  int64_t end = 0;
  for (int64_t f = 0; f < num_features; ++f) {
    for (int64_t b = 0; b < batch; ++b) end += lengths.at(f * batch + b);
    if (end > available)
      return " (feature '" + clip(keys[static_cast<size_t>(f)]) + "' is the first whose bags reach past the " +
             std::to_string(available) + " " + what + ")";
  }
  if (lengths.count && end < available)
    return " (" + std::to_string(available - end) + " " + what + " are left over after the last feature '" +
           clip(keys.back()) + "')";
  return "";
}

}  // namespace

void validate_concatenated(const std::vector<std::string>& keys, Array ids, Array lengths, const float* weights,
                           int64_t num_weights, const ModelShape& shape, Request& request) {
  const int64_t num_ids = ids.count;
  // SparseFeatures.__post_init__
  if (weights != nullptr && num_weights != num_ids)
    throw BadRequest(weights_count(num_weights, num_ids) +
                     first_feature_past(keys, lengths, num_ids, num_weights, "weights"));
  {
    std::map<std::string, int> counts;
    for (const auto& k : keys) ++counts[k];
    std::vector<std::string> repeated;
    for (const auto& [k, n] : counts)
      if (n > 1) repeated.push_back(k);
    if (!repeated.empty())
      throw BadRequest("duplicate feature names " + clip_names(repeated) + "; name each feature once");
  }
  if (keys.empty()) throw BadRequest("a batch needs at least one feature");
  // SparseFeatures.validate
  std::unordered_map<std::string, size_t> model_index;
  std::vector<std::string> expected;
  for (size_t i = 0; i < shape.features.size(); ++i) {
    model_index.emplace(shape.features[i].name, i);
    expected.push_back(shape.features[i].name);
  }
  std::vector<std::string> unknown;
  for (const auto& k : keys)
    if (!model_index.count(k)) unknown.push_back(k);
  if (!unknown.empty())
    throw BadRequest("unknown feature(s) " + clip_names(unknown) + "; the model's features are " +
                     clip_names(expected, 10));
  if (keys.size() != expected.size()) {
    std::set<std::string> present(keys.begin(), keys.end());
    std::vector<std::string> missing;
    for (const auto& k : expected)
      if (!present.count(k)) missing.push_back(k);
    throw BadRequest("missing feature(s) " + clip_names(missing) + "; every request must carry all " +
                     std::to_string(expected.size()) +
                     " features of the model (send empty bags for a feature with no ids)");
  }
  const int64_t num_features = static_cast<int64_t>(keys.size());
  if (lengths.count % num_features) throw BadRequest(uneven_batch(lengths.count, keys));
  const int64_t batch = lengths.count / num_features;
  for (int64_t i = 0; i < lengths.count; ++i)
    if (lengths.at(i) < 0)
      throw BadRequest("feature '" + keys[static_cast<size_t>(i / batch)] + "': bag " + std::to_string(i % batch) +
                       " has negative length " + std::to_string(lengths.at(i)));
  for (int64_t i = 0; i < lengths.count; ++i)
    if (lengths.at(i) > num_ids)  // before any sum: huge lengths could wrap it into a plausible total
      throw BadRequest("feature '" + keys[static_cast<size_t>(i / batch)] + "': bag " + std::to_string(i % batch) +
                       " has length " + std::to_string(lengths.at(i)) + " but the batch has only " +
                       std::to_string(num_ids) + " ids");
  // each length <= num_ids < 2^62 here, and at most 2^31 entries fit a message: the sums cannot wrap
  std::vector<int64_t> starts(keys.size()), ends(keys.size());
  int64_t total = 0;
  for (int64_t f = 0; f < num_features; ++f) {
    starts[static_cast<size_t>(f)] = total;
    for (int64_t b = 0; b < batch; ++b) total += lengths.at(f * batch + b);
    ends[static_cast<size_t>(f)] = total;
  }
  if (total != num_ids)
    throw BadRequest("lengths sum to " + std::to_string(total) + " but there are " + std::to_string(num_ids) +
                     " ids; lengths must add up to the number of ids" +
                     first_feature_past(keys, lengths, num_ids, num_ids, "ids"));
  for (size_t f = 0; f < keys.size(); ++f) {
    const int64_t rows = shape.features[model_index[keys[f]]].num_embeddings;
    for (int64_t i = starts[f]; i < ends[f]; ++i) {
      const int64_t id = ids.at(i);
      if (id < 0 || id >= rows)
        throw BadRequest("feature '" + keys[f] + "': id " + std::to_string(id) + " is out of range [0, " +
                         std::to_string(rows) + ") (id #" + std::to_string(i - starts[f]) + " of the feature)");
    }
  }
  // model order, in place
  request.batch = batch;
  request.weighted = weights != nullptr;
  request.features.assign(keys.size(), FeatureSlice{});
  bool in_order = true;
  for (size_t f = 0; f < keys.size(); ++f) {
    const size_t m = model_index[keys[f]];
    in_order = in_order && m == f;
    FeatureSlice& slice = request.features[m];
    slice.ids = {static_cast<const char*>(ids.data) + starts[f] * ids.width, ids.width, ends[f] - starts[f]};
    slice.lengths = {static_cast<const char*>(lengths.data) + static_cast<int64_t>(f) * batch * lengths.width,
                     lengths.width, batch};
    slice.weights = weights != nullptr ? weights + starts[f] : nullptr;
  }
  request.contiguous = in_order;
  if (in_order) {
    SparseBatch& whole = request.whole;
    whole.ids = ids.data;
    whole.id_width = ids.width;
    whole.num_ids = num_ids;
    whole.lengths = lengths.data;
    whole.length_width = lengths.width;
    whole.num_lengths = lengths.count;
    whole.weights = weights;
    whole.batch = batch;
  }
}

}  // namespace embserve::server
