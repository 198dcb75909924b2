// The Open Inference Protocol's tensor contract in plain C++ (server/adapters/oip/codec.py): the words of
// infer/request_rules.py, every size checked before anything is read.
#include "oip_codec.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

namespace embserve::server {

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

int oip_width(const std::string& datatype) {
  if (datatype == "INT64") return 8;
  if (datatype == "INT32" || datatype == "FP32") return 4;
  if (datatype == "FP16") return 2;
  return 0;
}

// "<feature>__<role>" or dense_features; false when the name is neither
static bool split_name(const std::string& name, std::string& feature, std::string& role) {
  if (name == kOipDense) {
    feature = role = kOipDense;
    return true;
  }
  const size_t at = name.rfind("__");
  if (at == std::string::npos || at == 0) return false;
  feature = name.substr(0, at);
  role = name.substr(at + 2);
  return role == "values" || role == "lengths" || role == "offsets" || role == "weights";
}

BadRequest refused_datatype(const std::string& name, const std::string& datatype) {
  std::string feature, role;
  if (!split_name(name, feature, role))
    return BadRequest("input " + py_repr(clip(name)) + ": datatype " + py_repr(clip(datatype)) +
                      " is not supported; use one of ['FP16', 'FP32', 'INT32', 'INT64']");
  std::string rule, allowed;
  if (role == "values") {
    rule = "values must be a 1-D int64 or int32 tensor of ids";
    allowed = "INT64 or INT32";
  } else if (role == "lengths" || role == "offsets") {
    rule = "lengths must be a 1-D int32 (or int64) tensor";
    allowed = "INT64 or INT32";
  } else if (role == "weights") {
    rule = "weights must be a 1-D float32 tensor with one weight per id";
    allowed = "FP32";
  } else {
    rule = "dense_features must be float32 [batch, num_dense_features]";
    allowed = "FP32";
  }
  return BadRequest("input " + py_repr(clip(name)) + ": " + rule + ", got " + clip(datatype) + " (send " + allowed +
                    ")");
}

static bool allowed_datatype(const std::string& role, const std::string& datatype) {
  if (role == "values" || role == "lengths" || role == "offsets") return datatype == "INT64" || datatype == "INT32";
  return datatype == "FP32";
}

// _checked_shape: the element count of a known datatype's shape
int64_t checked_count(const std::string& name, const std::string& datatype, const std::vector<int64_t>& dims,
                      __int128& exact) {
  if (!oip_width(datatype)) throw refused_datatype(name, datatype);
  for (int64_t d : dims)
    if (d < 0) throw BadRequest("input " + py_repr(name) + ": shape " + shape_text(dims) + " has a negative dimension");
  exact = 1;
  for (int64_t d : dims) {
    exact *= d;
    if (exact > (static_cast<__int128>(1) << 80)) exact = static_cast<__int128>(1) << 80;  // far past any message
  }
  return exact > INT64_MAX / 8 ? INT64_MAX / 8 : static_cast<int64_t>(exact);
}

std::string wide(__int128 value) {
  if (value <= INT64_MAX) return std::to_string(static_cast<int64_t>(value));
  std::string digits;
  while (value > 0) {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(value % 10)));
    value /= 10;
  }
  return digits;
}

bool truthy_text(std::string s) {
  const size_t b = s.find_first_not_of(" \t\n\r\f\v"), e = s.find_last_not_of(" \t\n\r\f\v");
  s = b == std::string::npos ? "" : s.substr(b, e - b + 1);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s == "1" || s == "true" || s == "yes";
}

static int64_t roles_weights_count(const OipInput* weights, int64_t num_values) {
  return weights != nullptr ? weights->data.count : num_values;
}

void decode_oip_inputs(const std::vector<OipInput>& inputs, const ModelShape& shape, Request& r) {
  struct Roles {
    const OipInput* values = nullptr;
    const OipInput* lengths = nullptr;
    const OipInput* offsets = nullptr;
    const OipInput* weights = nullptr;
  };
  std::vector<std::string> keys;
  std::map<std::string, Roles> by_feature;
  const OipInput* dense = nullptr;
  for (const OipInput& input : inputs) {
    std::string feature, role;
    if (!split_name(input.name, feature, role))
      throw BadRequest("unknown input tensor " + py_repr(input.name) +
                       "; inputs are '<feature>__values', '<feature>__lengths' or '<feature>__offsets', "
                       "'<feature>__weights' and 'dense_features'");
    if (!allowed_datatype(role, input.datatype)) throw refused_datatype(input.name, input.datatype);
    if (role == kOipDense) {
      if (dense != nullptr) throw BadRequest("input 'dense_features' appears twice");
      dense = &input;
      continue;
    }
    if (!by_feature.count(feature)) keys.push_back(feature);
    Roles& roles = by_feature[feature];
    const OipInput** slot = role == "values"    ? &roles.values
                         : role == "lengths" ? &roles.lengths
                         : role == "offsets" ? &roles.offsets
                                             : &roles.weights;
    if (*slot != nullptr) throw BadRequest("input " + py_repr(input.name) + " appears twice");
    *slot = &input;
  }
  std::vector<std::string> expected;
  for (const auto& f : shape.features) expected.push_back(f.name);
  if (keys.empty())
    throw BadRequest("missing feature(s) " + py_list(expected) +
                     "; send '<feature>__values' and '<feature>__lengths' (or '__offsets') for every feature");
  if (std::set<std::string>(keys.begin(), keys.end()) != std::set<std::string>(expected.begin(), expected.end())) {
    Request empty;  // validate names the unknown or missing features, in the library's words
    validate_concatenated(keys, Array{nullptr, 8, 0}, Array{nullptr, 4, 0}, nullptr, 0, shape, empty);
  }
  auto one_dim = [](const OipInput& input, const std::string& key) {
    (void)key;
    if (input.shape.size() != 1)
      throw BadRequest("input " + py_repr(input.name) + " must be 1-D, got shape " + shape_text(input.shape));
  };
    std::vector<Array> values(keys.size()), lengths(keys.size());
  std::vector<const float*> weights(keys.size(), nullptr);
  for (size_t k = 0; k < keys.size(); ++k) {
    const std::string& key = keys[k];
    const Roles& roles = by_feature[key];
    if (roles.values == nullptr) throw BadRequest("feature " + py_repr(key) + ": '" + key + "__values' is missing");
    one_dim(*roles.values, key);
    values[k] = roles.values->data;
    if (roles.lengths != nullptr && roles.offsets != nullptr)
      throw BadRequest("feature " + py_repr(key) + ": send '" + key + "__lengths' or '" + key +
                       "__offsets', not both");
    if (roles.lengths != nullptr) {
      one_dim(*roles.lengths, key);
      lengths[k] = roles.lengths->data;
    } else if (roles.offsets == nullptr) {
      throw BadRequest("feature " + py_repr(key) + ": '" + key + "__lengths' (or '" + key + "__offsets') is missing");
    } else {
      one_dim(*roles.offsets, key);
      const Array& offsets = roles.offsets->data;
      const int64_t num_values = values[k].count;
      if (offsets.count == 0 || offsets.at(0) != 0 || offsets.at(offsets.count - 1) != num_values)
        throw BadRequest("feature " + py_repr(key) + ": offsets must start at 0 and end at the " +
                         std::to_string(num_values) + " ids (batch + 1 entries), got first " +
                         (offsets.count ? std::to_string(offsets.at(0)) : "None") + " and last " +
                         (offsets.count ? std::to_string(offsets.at(offsets.count - 1)) : "None"));
      r.storage.emplace_back(static_cast<size_t>(offsets.count - 1) * 8);
      auto* diffs = reinterpret_cast<int64_t*>(r.storage.back().data());
      for (int64_t i = 0; i + 1 < offsets.count; ++i) {
        // offsets are int64 at most: their difference can overflow only past any valid id count
        diffs[i] = static_cast<int64_t>(static_cast<uint64_t>(offsets.at(i + 1)) - static_cast<uint64_t>(offsets.at(i)));
        if (offsets.at(i + 1) < offsets.at(i))
          throw BadRequest("feature '" + key + "': bag " + std::to_string(i) + " has negative length " +
                           std::to_string(diffs[i]));
      }
      lengths[k] = Array{diffs, 8, offsets.count - 1};
    }
    if (roles.weights != nullptr) {
      one_dim(*roles.weights, key);
      weights[k] = static_cast<const float*>(roles.weights->data.data);
    }
  }
  // _checked_batch
  int64_t total_entries = 0, total_ids = 0;
  for (size_t k = 0; k < keys.size(); ++k) total_entries += lengths[k].count, total_ids += values[k].count;
  const int64_t num_features = static_cast<int64_t>(keys.size());
  (void)total_entries;
  (void)num_features;
  // each feature against its own tensors (infer's OIP codec _checked_batch): counts named per feature
  for (size_t k = 1; k < keys.size(); ++k)
    if (lengths[k].count != lengths[0].count)
      throw BadRequest(bags_differ(keys[k], lengths[k].count, keys[0], lengths[0].count));
  for (size_t k = 0; k < keys.size(); ++k)
    for (int64_t b = 0; b < lengths[k].count; ++b)
      if (lengths[k].at(b) < 0)
        throw BadRequest("feature '" + keys[k] + "': bag " + std::to_string(b) + " has negative length " +
                         std::to_string(lengths[k].at(b)));
  for (size_t k = 0; k < keys.size(); ++k)
    for (int64_t b = 0; b < lengths[k].count; ++b)
      if (lengths[k].at(b) > total_ids)
        throw BadRequest("feature '" + keys[k] + "': bag " + std::to_string(b) + " has length " +
                         std::to_string(lengths[k].at(b)) + " but the batch has only " + std::to_string(total_ids) +
                         " ids");
  std::vector<int64_t> sums(keys.size(), 0);
  int64_t sum = 0;
  for (size_t k = 0; k < keys.size(); ++k) {
    for (int64_t b = 0; b < lengths[k].count; ++b) sums[k] += lengths[k].at(b);
    sum += sums[k];
  }
  auto lengths_sum = [](int64_t total, int64_t num_ids) {
    return "lengths sum to " + std::to_string(total) + " but there are " + std::to_string(num_ids) +
           " ids; lengths must add up to the number of ids";
  };
  (void)sum;
  for (size_t k = 0; k < keys.size(); ++k)
    if (sums[k] != values[k].count)
      throw BadRequest("feature '" + keys[k] + "': " + lengths_sum(sums[k], values[k].count));
  const bool weighted = std::any_of(weights.begin(), weights.end(), [](const float* w) { return w != nullptr; });
  if (weighted) {
    auto count = [](const std::string& what, int64_t given, int64_t num_ids) {
      return what + "weights has " + std::to_string(given) + " entries but there are " + std::to_string(num_ids) +
             " ids; give one weight per id";
    };
    for (size_t k = 0; k < keys.size(); ++k) {
      const int64_t part = roles_weights_count(by_feature[keys[k]].weights, values[k].count);
      if (part != values[k].count) throw BadRequest(count("feature '" + keys[k] + "': ", part, values[k].count));
    }
  }
  // validate: ids in range (request order), then the model order
  std::map<std::string, size_t> model_index;
  for (size_t i = 0; i < shape.features.size(); ++i) model_index[shape.features[i].name] = i;
  for (size_t k = 0; k < keys.size(); ++k) {
    const int64_t rows = shape.features[model_index[keys[k]]].num_embeddings;
    for (int64_t i = 0; i < values[k].count; ++i) {
      const int64_t id = values[k].at(i);
      if (id < 0 || id >= rows)
        throw BadRequest("feature '" + keys[k] + "': id " + std::to_string(id) + " is out of range [0, " +
                         std::to_string(rows) + ") (id #" + std::to_string(i) + " of the feature)");
    }
  }
  r.batch = lengths[0].count;
  r.weighted = weighted;
  r.features.assign(keys.size(), FeatureSlice{});
  for (size_t k = 0; k < keys.size(); ++k) {
    FeatureSlice& slice = r.features[model_index[keys[k]]];
    slice.ids = values[k];
    slice.lengths = lengths[k];
    slice.weights = weights[k];
  }
  r.contiguous = false;
  if (dense != nullptr) {
    const int64_t num_dense = shape.num_dense_features;
    if (dense->shape != std::vector<int64_t>{r.batch, num_dense})
      throw BadRequest("input 'dense_features': dense_features must have shape [" + std::to_string(r.batch) + ", " +
                       std::to_string(num_dense) + "], got " + shape_text(dense->shape));
    r.dense = static_cast<const float*>(dense->data.data);
  }
  if (r.dense != nullptr && shape.num_dense_features <= 0)
    throw BadRequest("this model has no dense part; drop the input 'dense_features'");
}

OipOutputs choose_oip_outputs(std::vector<OipOutput> requested, bool has_dense, bool dense_given, bool fp16) {
  if (requested.empty()) {
    requested.push_back({kOipEmbeddings, fp16});
    if (dense_given) requested.push_back({kOipScores, false});
  }
  std::vector<std::string> names;
  for (const auto& o : requested) names.push_back(o.name);
  for (const auto& n : names)
    if (n != kOipEmbeddings && !(has_dense && n == kOipScores))
      throw BadRequest("unknown output " + py_repr(n) + "; this model's outputs are " +
                       (has_dense ? "['embeddings', 'scores']" : "['embeddings'] (this model has no dense part: no scores)"));
  if (std::set<std::string>(names.begin(), names.end()).size() != names.size())
    throw BadRequest("outputs " + py_list(names) + " list a name twice");
  OipOutputs chosen;
  chosen.scores = std::find(names.begin(), names.end(), kOipScores) != names.end();
  chosen.embeddings = std::find(names.begin(), names.end(), kOipEmbeddings) != names.end();
  if (chosen.scores && !dense_given)
    throw BadRequest("output 'scores' needs the input 'dense_features' (FP32 [batch, num_dense])");
  chosen.outputs = std::move(requested);
  return chosen;
}

std::string python_json(const std::map<std::string, std::string>& mapping) {
  std::string out = "{";
  for (const auto& [key, value] : mapping)
    out += (out.size() > 1 ? ", " : "") + nlohmann::json(key).dump(-1, ' ', true) + ": " +
           nlohmann::json(value).dump(-1, ' ', true);
  return out + "}";
}

}  // namespace embserve::server
