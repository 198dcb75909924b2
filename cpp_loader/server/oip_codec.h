// The Open Inference Protocol's tensor contract (server/adapters/oip/codec.py), shared by its gRPC handlers
// (service.cpp) and its REST ones (http.cpp): per-feature input tensors -> one validated request in the model's
// order (request.h's rules and words), and the outputs a request asks for. Plain C++: no protobuf, no torch.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "request.h"
#include "runner.h"

namespace embserve::server {

constexpr const char* kOipDense = "dense_features";
constexpr const char* kOipEmbeddings = "embeddings";
constexpr const char* kOipScores = "scores";

// One input as it came: its name, protocol datatype, shape and data (elements of the datatype's width).
struct OipInput {
  std::string name, datatype;
  std::vector<int64_t> shape;
  Array data;
};

// One output to compute: its name and whether its embeddings travel as FP16.
struct OipOutput {
  std::string name;
  bool fp16 = false;
};

// The forward an infer call needs (codec.Mode), from its outputs.
struct OipOutputs {
  std::vector<OipOutput> outputs;
  bool embeddings = false;  // an output is 'embeddings'
  bool scores = false;      // an output is 'scores'
};

// bytes per element of a datatype (0: not one the protocol's tensors take)
int oip_width(const std::string& datatype);
std::string shape_text(const std::vector<int64_t>& dims);  // Python's list: [2, 3]
std::string wide(__int128 value);                           // an exact element count, in decimal
// codec.refused_datatype: an input whose datatype the call contract refuses, in its words
BadRequest refused_datatype(const std::string& name, const std::string& datatype);
// codec._checked_shape: the element count of a shape (capped far past any message; `exact` the true product,
// saturated at 2^80); BadRequest for an unknown datatype or a negative dimension
int64_t checked_count(const std::string& name, const std::string& datatype, const std::vector<int64_t>& dims,
                      __int128& exact);
// a string parameter's truth (codec.parameter_flag): "1", "true" or "yes", case and spaces aside
bool truthy_text(std::string text);

// codec.decode_inputs (+ _checked_batch, _dense): the inputs as one validated request in the model's feature
// order, in place where the inputs' bytes allow (`request.storage` holds what they do not); the dense features
// checked against the model.
void decode_oip_inputs(const std::vector<OipInput>& inputs, const ModelShape& shape, Request& request);

// codec.choose_outputs: the outputs to compute (none requested: embeddings, FP16 when `fp16`, and scores when the
// request carries dense features); BadRequest in Python's words for an unknown, repeated or impossible one.
OipOutputs choose_oip_outputs(std::vector<OipOutput> requested, bool has_dense, bool dense_given, bool fp16);

// json.dumps(mapping, sort_keys=True) of str -> str (Python's separators ", " and ": "): the metadata's
// failed_versions property (OipCore.model_metadata), over gRPC and REST alike
std::string python_json(const std::map<std::string, std::string>& mapping);

}  // namespace embserve::server
