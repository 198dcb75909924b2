// The torch seam of embserve-server: the model behind plain C++ types. runner.cpp is the only translation unit
// of the server that includes the loader (and with it torch); nothing here names a torch or protobuf type.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace embserve::server {

// A request the model refused (the loader's RequestError, in Python's words): INVALID_ARGUMENT.
class RunnerRequestError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// Anything else the loader or torch raised: the artifact cannot be loaded, or a forward failed (INTERNAL).
// `kind`: the loader's error as Python's describe_failure names it ("ArtifactError(kind=checksum)", ...), or empty.
class RunnerError : public std::runtime_error {
 public:
  explicit RunnerError(const std::string& message, std::string kind = "")
      : std::runtime_error(message), kind(std::move(kind)) {}
  std::string kind;
};

struct FeatureColumns {
  std::string name;
  std::string table;
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  std::string pooling;
  int64_t column_start = 0;
  int64_t column_end = 0;
};

// What the server needs to know of the loaded model (the rest of its metadata comes from manifest.json).
struct ModelShape {
  std::vector<FeatureColumns> features;  // model order: the output's column order
  int64_t output_dim = 0;
  int64_t num_dense_features = 0;  // 0: no dense part (Predict is FAILED_PRECONDITION)
  int world_size = 1;
};

// One merged batch in the model's feature order (feature-major jagged layout), read where it lies: the pointers
// point into request bytes or the batcher's merge buffers, and stay valid for the call.
struct SparseBatch {
  const void* ids = nullptr;  // int64 (id_width 8) or int32 (4) [num_ids]
  int id_width = 8;
  int64_t num_ids = 0;
  const void* lengths = nullptr;  // int32 (4) or int64 (8) [num_features * batch]
  int length_width = 4;
  int64_t num_lengths = 0;
  const float* weights = nullptr;  // [num_ids], or null: every id weighs 1
  const float* dense = nullptr;    // [batch, num_dense_features] (predict and both), or null
  int64_t batch = 0;
};

enum class Forward { Lookup, Predict, Both };

// Where the rows [row_start, row_start + rows) of a forward's output go: written once, straight into a
// response's buffer. embeddings: float32 or (embeddings_fp16) float16 [rows, output_dim]; scores: float32 [rows].
struct Destination {
  int64_t row_start = 0;
  int64_t rows = 0;
  void* embeddings = nullptr;  // null: not wanted
  bool embeddings_fp16 = false;
  float* scores = nullptr;  // null: not wanted
};

// The loader's thread settings (main.cpp derives them from the host's cores and the flags, as server/app.py).
struct RunnerOptions {
  bool verify_full = true;
  int intra_op_threads = -1;  // LoadOptions.intra_op_threads: torch threads per forward
  int kernel_threads = -1;    // LoadOptions.kernel_threads: example ranges a CPU kernel splits a batch into
  bool pt2 = false;           // --backend pt2: model.pt2 (AOTInductor) runs the forwards instead of model.pt
  // --hot-rows-file: JSON {"table": [row, ...]} of rows served from a resident cache (LoadOptions.hot_rows); empty:
  // none. A bad file or row is a RunnerError of kind "ConfigError" naming the flag.
  std::string hot_rows_file;
  std::string prefetch = "auto";  // --prefetch: LoadOptions.prefetch (auto, on, off)
};

class Runner {
 public:
  // Load the artifact (TorchScript, or pt2 when options.pt2). Throws RunnerError with the loader's message.
  static std::unique_ptr<Runner> load(const std::string& artifact_dir, const RunnerOptions& options);
  virtual ~Runner() = default;
  virtual const ModelShape& shape() const = 0;
  // One forward of `batch`, its output rows written to `destinations`. The batch must have passed the server's
  // checks (request.h: the loader's request rules): the loader's unchecked entries run it as it is. Throws
  // RunnerRequestError or RunnerError.
  virtual void run(Forward forward, const SparseBatch& batch, const std::vector<Destination>& destinations) const = 0;
};

}  // namespace embserve::server
