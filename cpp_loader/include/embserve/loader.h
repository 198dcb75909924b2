// embserve C++ loader: load an exported embserve artifact with libtorch (no Python) and run lookups.
//
//   auto model = embserve::Model::load("artifacts/quickstart");
//   at::Tensor pooled = model.lookup(values, lengths);      // [batch, output_dim] float32
//   at::Tensor scores = model.predict(dense, values, lengths);  // [batch] float32 (models with a dense part)
//
// The call contract (as every Python entry point): values int64 or int32, lengths int32 or int64, weights float32
// or absent, dense_features float32; a documented dtype is cast at the boundary to what the backend runs, any
// other is refused with a RequestError naming the tensor, its dtype and shape, and the accepted dtypes.
//
// Every failure is an exception deriving from embserve::Error (itself a std::runtime_error).
// Two backends run the same lookups, bit-identical: the TorchScript model.pt (default) and the AOTInductor
// package model.pt2 (LoadOptions.backend = Backend::Pt2; artifacts exported with `embserve export --pt2`).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>

namespace torch::jit {
struct Module;
struct Method;
}
namespace torch::inductor {
class AOTIModelPackageLoader;
}

namespace embserve {
namespace hot_rows {
class HotRowCache;
}
namespace prefetch {
class Prefetcher;
}

// Base of every error the loader raises.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// manifest.json or plan.json is missing, not JSON, of another format/version, breaks the artifact schema
// (infer/artifact/schema.json: the message names the key path), or its parts disagree with each other.
class ManifestError : public Error {
 public:
  using Error::Error;
};
// A file listed in the manifest is missing, has the wrong size (checked before any file is mapped), or fails its
// sha256 check (for a file with chunk digests: the message names the bad chunk and its byte range).
class ChecksumError : public Error {
 public:
  using Error::Error;
};
// An fbgemm operator library is not found in any searched folder, or dlopen fails.
class LibraryError : public Error {
 public:
  using Error::Error;
};
// TorchScript cannot load or run the model (unknown operator or type, bad archive, ...), or a kernel's
// metadata or weight storage differs from what the manifest's `kernels` entry implies; on the Pt2 backend,
// model.pt2 was compiled by another torch version, or AOTInductor cannot load or run it.
class ModelError : public Error {
 public:
  using Error::Error;
};
// A lookup or predict request is invalid; the message names the tensor or feature and the bad value.
class RequestError : public Error {
 public:
  using Error::Error;
};
// A load option is invalid (Python's ConfigError): hot rows naming an unknown table or a row outside its table, a
// hot-rows file that cannot be read; the message names the option or file and the fix.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Which of the artifact's model files runs the lookups.
enum class Backend {
  TorchScript,  // model.pt with torch::jit::load (every artifact has it)
  Pt2,          // model.pt2 with torch::inductor::AOTIModelPackageLoader (the manifest's `pt2` entry)
};

// How much of the artifact's files the load checks (Python's load(..., verify=...), `--verify full|none`).
enum class Verify {
  Full,  // every listed file's size and sha256 (large files chunk by chunk on a thread per core) before ready
  None,  // paths and sizes only (a file of the wrong size is still refused before anything maps it): for a trusted
         // artifact verified before
};

// Whether lookups read their pages of a mapped artifact ahead (Python's load(..., prefetch=...)).
enum class Prefetch {
  Auto,  // on when the artifact is mapped and its plan puts a shard in the paged tier
  On,    // MADV_RANDOM on the mappings, and each batch's pages asked for (MADV_WILLNEED, a pool of threads) first
  Off,
};

// Rows to keep in a resident hot-row cache, per table: (table name, row ids) (Python's load(..., hot_rows=...)).
using HotRows = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// The rows of a hot-rows file: JSON {"table": [row, ...], ...} (what `embserve serve --native` writes from
// --hot-rows-sample: infer.artifact.paged.hot_rows_from_sample). Throws ConfigError naming the file.
HotRows read_hot_rows(const std::string& path);

struct LoadOptions {
  Backend backend = Backend::TorchScript;
  // Folders searched first for the fbgemm libraries; then $EMBSERVE_FBGEMM_LIB_DIR, the manifest's
  // fbgemm.build_dir, and the fbgemm_gpu folder recorded when embserve_loader was built.
  std::vector<std::string> library_dirs;
  // Verify::Full checks every listed file's sha256 as well as its size (as the Python loader does).
  Verify verify = Verify::Full;
  // torch intra-op threads (process-wide): -1 = as Python's load (cores / world_size for models
  // sharded over several CPU devices, unchanged otherwise); 0 = leave alone; n > 0 = set n.
  // Pt2: -1 leaves torch's setting alone.
  int intra_op_threads = -1;
  // Example ranges each CPU kernel may split a batch into, run in parallel on the same weights (output
  // bit-identical): -1 = as Python's load (cores / CPU kernels, at least 1); 0 = as exported; n > 0 = n.
  // Pt2: the loader splits the batch itself into at most kernel_threads ranges (-1 = cores, 0 = one range), run
  // by the calling thread and helpers on torch's inter-op pool (at::launch, as TorchScript's fork); the package
  // gets that many runners (AOTInductor model instances sharing one copy of the constants), at least 2.
  int kernel_threads = -1;
  // Rows served from a resident cache in front of a mapped artifact's tables (TorchScript backend, a model with one
  // CPU kernel): the rows are copied at load and their pages in the mapping let go; every lookup splits its ids
  // between the cache and the model and adds the cache's sums in Python's order (outputs equal Python's load with
  // the same hot_rows, bit for bit). Empty: no cache. ConfigError for an unknown table or a row outside its table.
  HotRows hot_rows;
  // Read each batch's pages ahead of the kernel (a mapped artifact on the TorchScript backend, as Python's load; an
  // embedded artifact or a pt2 program is left alone). This loader reads ahead for a model with one CPU kernel: Auto
  // leaves a sharded one alone, On refuses it with a ConfigError.
  Prefetch prefetch = Prefetch::Auto;
};

// The hot-row cache a model holds (all zero without one).
struct HotRowCacheInfo {
  int64_t rows = 0;
  int64_t tables = 0;
  int64_t bytes = 0;
};

struct FeatureInfo {
  std::string name;
  std::string table;
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  std::string pooling;
  int64_t column_start = 0;
  int64_t column_end = 0;
};

// Check an artifact's manifest.json (and plan.json, when sharded) against the artifact schema and against
// each other, without hashing files or loading the model: a pre-flight check for deploy tooling.
// Throws ManifestError (ChecksumError for a model, plan or weight file the manifest names without a checksum entry).
void check_manifest(const std::string& artifact_dir);

class Model {
 public:
  // Verify and load the artifact folder written by embserve's export. Throws embserve::Error.
  static Model load(const std::string& artifact_dir, const LoadOptions& options = LoadOptions());

  // Pooled embeddings [batch, output_dim] float32, columns per feature in feature_names() order.
  // values: 1-D int32/int64 ids; lengths: 1-D int32/int64, num_features * batch bag lengths,
  // feature-major; weights: optional 1-D float32, one per id (std::nullopt or an undefined tensor: every id weighs
  // 1). Throws RequestError on bad input.
  // Safe to call from several threads on one Model (Pt2: at most `runners` program runs at once; more wait).
  at::Tensor lookup(const at::Tensor& values, const at::Tensor& lengths,
                    const std::optional<at::Tensor>& weights = std::nullopt) const;

  // Scores [batch] float32 of the model's dense part on dense_features [batch, num_dense_features()] float32 and
  // the pooled lookups of (values, lengths, weights), taken as lookup takes them. TorchScript runs model.pt's
  // `predict`; Pt2 runs the package's lookup program, then its dense program (the manifest's pt2.dense_program).
  // A dense part's [batch, 1] result is squeezed to [batch]. Throws RequestError for a model without a dense part
  // or a bad request; ModelError when model.pt2 carries no dense program or the dense part returns another shape.
  at::Tensor predict(const at::Tensor& dense_features, const at::Tensor& values, const at::Tensor& lengths,
                     const std::optional<at::Tensor>& weights = std::nullopt) const;

  // lookup of a request the caller validated already with validate()'s rules (a serving front end that checks every
  // request itself, as embserve-server does): nothing is checked again. TorchScript runs model.pt's
  // `lookup_unchecked` (an artifact exported before it had one runs the checked forward), Pt2 its program. Anything
  // else must call lookup: an unchecked bad request reaches the kernel, whose bounds check is then the only guard.
  at::Tensor lookup_unchecked(const at::Tensor& values, const at::Tensor& lengths,
                              const std::optional<at::Tensor>& weights = std::nullopt) const;

  // Pooled embeddings [batch, output_dim] and scores [batch] float32 of one forward of a validated request (as
  // lookup_unchecked; the dense features' shape is still checked): model.pt's `lookup_and_predict_unchecked`.
  std::pair<at::Tensor, at::Tensor> lookup_and_predict_unchecked(
      const at::Tensor& dense_features, const at::Tensor& values, const at::Tensor& lengths,
      const std::optional<at::Tensor>& weights = std::nullopt) const;

  // Check a request without running it (lookup does this itself). Throws RequestError.
  void validate(const at::Tensor& values, const at::Tensor& lengths,
                const std::optional<at::Tensor>& weights) const;

  const std::vector<FeatureInfo>& features() const { return features_; }
  std::vector<std::string> feature_names() const;
  int64_t output_dim() const { return output_dim_; }
  // Whether the artifact has a dense part (manifest dense.present), and how many dense features predict takes.
  bool has_dense() const { return num_dense_features_ > 0; }
  int64_t num_dense_features() const { return num_dense_features_; }
  int world_size() const { return world_size_; }
  const std::string& path() const { return path_; }
  Backend backend() const { return backend_; }
  // Whether lookup_unchecked runs fbgemm's op directly (a CPU model with one plain kernel), not the TorchScript
  // interpreter; $EMBSERVE_FORCE_TORCHSCRIPT=1 at load forces the interpreter.
  bool direct_lookup() const { return direct_ != nullptr; }
  // Absolute paths of the fbgemm libraries loaded for this model, in load order.
  const std::vector<std::string>& libraries() const { return libraries_; }
  // What the load read or mapped (the bytes of every file the manifest lists), how long Model::load took, and how
  // much of that was dlopen'ing the fbgemm libraries (near 0 when this process loaded them before).
  int64_t load_bytes() const { return load_bytes_; }
  double load_seconds() const { return load_seconds_; }
  double library_seconds() const { return library_seconds_; }
  // The resident hot-row cache (LoadOptions.hot_rows): rows, tables and bytes; all zero without one.
  HotRowCacheInfo hot_row_cache() const;
  // Whether lookups read their pages ahead (LoadOptions.prefetch).
  bool prefetching() const { return prefetch_ != nullptr; }

 private:
  Model() = default;
  std::string path_;
  std::vector<FeatureInfo> features_;
  int64_t output_dim_ = 0;
  int64_t num_dense_features_ = 0;  // 0: no dense part
  int world_size_ = 1;
  std::vector<std::string> libraries_;
  int64_t load_bytes_ = 0;
  double load_seconds_ = 0.0;
  double library_seconds_ = 0.0;
  Backend backend_ = Backend::TorchScript;
  std::shared_ptr<torch::jit::Module> module_;
  // the weight files a Pt2 program reads (a mapped artifact's): declared before the program, so released after it
  std::vector<std::shared_ptr<void>> pt2_mappings_;
  std::shared_ptr<torch::inductor::AOTIModelPackageLoader> pt2_;
  std::shared_ptr<torch::inductor::AOTIModelPackageLoader> pt2_dense_;  // the package's dense program, or null
  std::string program_path_;  // the file that runs: model.pt or model.pt2
  int pt2_threads_ = 1;  // example ranges a Pt2 lookup may split a batch into
  // TorchScript methods of a model whose kernels are all on CPU run without the profiling/optimizing executor (as
  // Python's Runtime.plain_execution): on CPU, where torch fuses nothing, its plan runs no faster, and re-planning
  // each method on its first calls costs warm-up CPU. The setting is per thread, set around each call.
  bool plain_execution_ = false;
  // model.pt's unchecked entries (null: an artifact exported before them; the checked methods run instead)
  std::shared_ptr<const torch::jit::Method> lookup_unchecked_, lookup_and_predict_unchecked_, lookup_and_predict_;
  // A Lookup without the TorchScript interpreter (build_direct_plan): for a CPU model with one plain kernel (no
  // shards, no precision blocks, no pruning or cache), fbgemm's lookup op on the kernel's own buffers, then the
  // MEAN division, as the scripted lookup_unchecked computes it (the same op on the same arguments; called through
  // a typed handle with the bag offsets in a per-thread buffer where the op's kernel signature allows). Null: the
  // TorchScript path ($EMBSERVE_FORCE_TORCHSCRIPT=1 forces it).
  struct DirectPlan;
  std::shared_ptr<const DirectPlan> direct_;
  void build_direct_plan();
  at::Tensor lookup_direct(const DirectPlan& plan, const at::Tensor& values, const at::Tensor& lengths,
                           const std::optional<at::Tensor>& weights) const;

  // A resident cache of hot rows in front of the mapped tables (LoadOptions.hot_rows), or null.
  std::shared_ptr<const hot_rows::HotRowCache> hot_;
  void build_hot_rows(const HotRows& rows);
  // Reads each batch's pages ahead (LoadOptions.prefetch), or null.
  std::shared_ptr<prefetch::Prefetcher> prefetch_;
  void build_prefetch(Prefetch mode, bool paged_plan);
  void read_ahead(const at::Tensor& values, const at::Tensor& lengths) const;
  // lookup_unchecked without the cache: the model's own entry (direct plan, or the scripted method)
  at::Tensor lookup_model(const at::Tensor& values, const at::Tensor& lengths,
                          const std::optional<at::Tensor>& weights) const;
  // lookup_unchecked through the cache (hot_ set): the ids split, the cold ones to lookup_model, the sums added
  at::Tensor lookup_cached(const at::Tensor& values, const at::Tensor& lengths,
                           const std::optional<at::Tensor>& weights) const;
  // the dense part on pooled lookups (model.pt's `score`), for a forward that pooled through the cache
  at::Tensor score(const at::Tensor& dense_features, const at::Tensor& pooled, int64_t batch) const;

  at::Tensor lookup_pt2(const at::Tensor& values, const at::Tensor& lengths,
                        const std::optional<at::Tensor>& weights) const;
  void validate_dense(const at::Tensor& dense_features, int64_t batch) const;
  void check_dense_program() const;  // Pt2: ModelError when the package has no dense program
  at::Tensor score_pt2(const at::Tensor& dense_features, const at::Tensor& pooled, int64_t batch) const;
};

}  // namespace embserve
