// What embserve-server serves: one artifact (model version "1" for the process's life) or a model repository
// (REPO/<model>/<version>/, server/repository.py's rules in plain C++). A served version is held by shared_ptr: a
// call takes one reference when it finds its model and drops it when it is answered, so a swap (one assignment
// under the lock) never waits for calls, and a retired version's batchers, runner and mapped files go when the
// last call holding it returns. No torch and no protobuf here (runner.h's plain types).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "batcher.h"
#include "runner.h"
#include "statistics.h"

namespace embserve::server {

class Metrics;

// What the metadata of a served model says beyond the runner's shape (read from manifest.json).
struct TableInfo {
  std::string name;
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  std::string data_type;
  std::string pooling;
  std::vector<std::string> feature_names;
};
struct ModelInfo {
  std::string name;     // the OIP model name (--model-name, else the artifact folder's name)
  std::string sha256;   // the model file's
  std::string version;  // its first 16 hex digits
  int format_version = 0;
  std::vector<TableInfo> tables;
  std::vector<std::string> devices;
  int world_size = 1;
};
ModelInfo read_model_info(const std::string& artifact_dir, const std::string& model_name);

// A folder of model folders (server/repository.py is_repository): a folder with no manifest.json and none of an
// artifact's own files (model.pt, model.pt2, model.onnx, plan.json, weights-<n>.bin; the loader names what an
// artifact that lost its manifest misses).
bool is_repository(const std::string& path);

// One loaded version of a model with everything a call needs: its runner, batchers (the calls of one version
// batch together, never with another version's), statistics and metadata. Members are destroyed in reverse
// order: the batchers (their threads joined) before the runner they run.
struct ServedVersion {
  std::string name;     // the OIP model name
  std::string version;  // the OIP version: "1" for one artifact, the folder's number in a repository
  std::unique_ptr<Runner> runner;
  ModelInfo info;
  Statistics statistics;  // before the batchers, which report to it
  std::unique_ptr<Batcher> lookups, predictions, both;  // predictions and both: models with a dense part
  std::string v1_metadata;   // embserve.v1 ModelMetadata bytes
  std::string oip_metadata;  // ModelMetadataResponse bytes, without `versions` (filled per answer)
  std::string oip_config;    // ModelConfigResponse bytes
  std::string oip_metadata_json;  // the metadata in its JSON shape (REST), without "versions" (filled per answer)
  std::string oip_config_json;    // the configuration in its JSON shape (REST)

  const ModelShape& shape() const { return runner->shape(); }
  void flush() const;
  int64_t held() const;
  size_t depth() const;
};

// The deleter of every ServedVersion: the last holder (often a completion-queue thread answering the version's last
// call) only queues it; a background thread at the lowest CPU priority joins its batchers and frees its runner
// (unmapping its files), off the serving path, and logs "model m version v freed".
void release_in_background(ServedVersion* version);

// A refusal of the model set, with the status the gRPC (and REST) front ends answer.
struct ModelSetError : std::runtime_error {
  enum class Code { NotFound, FailedPrecondition, InvalidArgument };
  ModelSetError(Code code, const std::string& message, const char* reason)
      : std::runtime_error(message), code(code), reason(reason) {}
  Code code;
  const char* reason;  // embserve_rejected_total's reason
};

// --version-policy: the latest N versions, or an explicit list (server/repository.py VersionPolicy).
struct VersionPolicy {
  int latest = 1;
  std::vector<int64_t> versions;  // non-empty: exactly these
  static VersionPolicy parse(const std::string& text);  // throws std::invalid_argument in Python's words
  std::vector<int64_t> select(std::vector<int64_t> available) const;
  std::string describe() const;  // as Python's repr in messages
};

// Loads one version folder: runner, batchers, metadata, warm-up; throws RunnerError (or std::exception) when the
// version cannot serve.
using VersionLoader =
    std::function<std::shared_ptr<ServedVersion>(const std::string& folder, const std::string& name,
                                                 const std::string& version)>;

struct IndexEntry {
  std::string name, version, state, reason;
};

class ModelSet {
 public:
  // One artifact: `model` as version "1"; load is a no-op, unload refused.
  explicit ModelSet(std::shared_ptr<ServedVersion> model);
  // A repository: nothing loaded until load_all.
  ModelSet(std::string root, VersionPolicy policy, VersionLoader loader, Metrics* metrics);
  ~ModelSet();
  ModelSet(const ModelSet&) = delete;
  ModelSet& operator=(const ModelSet&) = delete;

  bool is_repository() const { return !root_.empty(); }
  // Load every model of the repository (start-up); throws std::runtime_error when no version of any model loads.
  void load_all();
  // Look for new, changed and removed versions every `seconds` on a thread of its own (0: never).
  void start_polling(double seconds);
  void poll_once();

  // The version a call runs on, held by the caller (version empty: the newest). Throws ModelSetError NotFound.
  std::shared_ptr<ServedVersion> find(const std::string& name, const std::string& version) const;
  // embserve.v1's model: the named one, else the default (the first model by name; it moves when unloaded).
  std::shared_ptr<ServedVersion> v1_target(const std::string& name, const std::string& version) const;
  std::vector<std::string> versions(const std::string& name) const;  // loaded, ascending; NotFound if none
  std::vector<std::shared_ptr<ServedVersion>> served() const;       // every loaded version, by name then version
  std::map<std::string, std::string> failures(const std::string& name) const;  // version -> why, not loaded
  bool ready(const std::string& name, const std::string& version) const;
  std::vector<IndexEntry> index(bool ready_only) const;
  // The repository extension (blocking: runs on a thread of the caller's). Throws ModelSetError.
  void load(const std::string& name);
  void unload(const std::string& name);

  void flush() const;  // the drain began: every version's batches run at once
  int64_t held() const;
  double depth() const;

 private:
  using Versions = std::map<int64_t, std::shared_ptr<ServedVersion>>;
  struct Failed {
    std::pair<int64_t, int64_t> signature;  // the manifest's mtime and size when it failed
    std::string why;
  };
  std::string root_;
  VersionPolicy policy_;
  VersionLoader loader_;
  Metrics* metrics_ = nullptr;
  mutable std::mutex mutex_;  // models_, failed_, v1_model_: held for lookups and swaps only, never for a load
  std::map<std::string, Versions> models_;
  std::map<std::pair<std::string, int64_t>, Failed> failed_;
  std::string v1_model_;
  std::mutex sync_mutex_;  // one sync at a time (the poller, load and unload calls)
  std::thread poller_;
  std::mutex poll_mutex_;
  std::condition_variable poll_wake_;
  bool stopping_ = false;

  std::vector<std::string> model_names() const;  // the repository's model folders
  std::vector<int64_t> available_versions(const std::string& name) const;
  void sync(const std::string& name, bool explicit_load);
  void retire(std::shared_ptr<ServedVersion> version, const char* why) const;
  std::string for_client(const std::string& message) const;
};

}  // namespace embserve::server
