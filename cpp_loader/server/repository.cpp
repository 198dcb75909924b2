// The model set of embserve-server: one artifact, or a model repository with hot swap (server/repository.py's
// rules and words). A new version is loaded, verified and warmed by the VersionLoader beside the serving ones,
// then swapped in by one assignment under the lock; a retired version is flushed and dropped, and goes when the
// last call holding it returns. A version that fails never replaces a good one and is reported with its error.
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "metrics.h"
#include "model_set.h"
#include "request.h"

namespace embserve::server {
namespace fs = std::filesystem;

namespace {

using Code = ModelSetError::Code;

std::string join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? separator : "") + parts[i];
  return out;
}

// Python's int() of a folder or version name made of ASCII digits only (false: not a version)
bool version_number(const std::string& text, int64_t& value) {
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos) return false;
  value = std::stoll(text);
  return true;
}

// server/repository.py _signature: changes when the version's folder is rewritten (a failed one is retried then)
std::pair<int64_t, int64_t> signature(const std::string& folder) {
  struct stat info {};
  if (stat((folder + "/manifest.json").c_str(), &info) != 0) return {0, 0};
  return {static_cast<int64_t>(info.st_mtim.tv_sec) * 1000000000 + info.st_mtim.tv_nsec,
          static_cast<int64_t>(info.st_size)};
}

// server/repository.py describe_failure: the message, then the error's class (and kind, for an artifact error)
std::string describe_failure(const std::exception& err) {
  if (const auto* runner = dynamic_cast<const RunnerError*>(&err); runner != nullptr && !runner->kind.empty())
    return std::string(err.what()) + " [" + runner->kind + "]";
  return std::string("RuntimeError: ") + err.what();
}

// server/repository.py available_memory_bytes: MemAvailable of /proc/meminfo (-1 where there is none)
int64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return -1;
}

// server/repository.py artifact_bytes: the memory a version needs beside the loaded ones, its files except mapped
// weight files (they live in the page cache, shared and evictable)
int64_t artifact_bytes(const std::string& folder) {
  std::set<std::string> mapped;
  try {
    std::ifstream file(folder + "/manifest.json");
    const nlohmann::json manifest = nlohmann::json::parse(file);
    for (const auto& kernel : manifest.at("kernels"))
      if (kernel.contains("weights") && !kernel["weights"].is_null())
        mapped.insert(kernel["weights"].at("file").get<std::string>());
  } catch (const std::exception&) {
    // the load that follows names what is wrong
  }
  int64_t total = 0;
  std::error_code error;
  for (auto it = fs::recursive_directory_iterator(folder, error); !error && it != fs::recursive_directory_iterator();
       it.increment(error))
    if (it->is_regular_file(error) && !mapped.count(fs::relative(it->path(), folder, error).generic_string()))
      total += static_cast<int64_t>(it->file_size(error));
  return total;
}

void log(const std::string& level, const std::string& message) {
  std::cerr << level << " embserve-server: " << message << std::endl;
}

}  // namespace

bool is_repository(const std::string& path) {
  std::error_code error;
  if (!fs::is_directory(path, error)) return false;
  for (const char* name : {"manifest.json", "model.pt", "model.pt2", "model.onnx", "plan.json"})
    if (fs::exists(fs::path(path) / name, error)) return false;
  for (const auto& entry : fs::directory_iterator(path, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("weights-", 0) == 0 && name.size() >= 12 && name.compare(name.size() - 4, 4, ".bin") == 0)
      return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------------ VersionPolicy
VersionPolicy VersionPolicy::parse(const std::string& text) {
  const size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon), value = colon == std::string::npos ? "" : text.substr(colon + 1);
  VersionPolicy policy;
  bool ok = true;
  auto number = [&](const std::string& item) -> int64_t {
    size_t used = 0;
    int64_t n = 0;
    try {
      n = std::stoll(item, &used);
    } catch (const std::exception&) {
      ok = false;
    }
    if (ok && item.find_first_not_of(" \t", used) != std::string::npos) ok = false;
    return n;
  };
  if (kind == "latest") {
    policy.latest = static_cast<int>(number(value.empty() ? "1" : value));
  } else if (kind == "versions") {
    std::stringstream items(value);
    for (std::string item; std::getline(items, item, ',');)
      if (item.find_first_not_of(" \t") != std::string::npos) policy.versions.push_back(number(item));
  } else {
    ok = false;
  }
  if (!ok) throw std::invalid_argument("version policy " + py_repr(text) + ": write 'latest:N' or 'versions:1,3'");
  if (policy.latest < 1 && policy.versions.empty())
    throw std::invalid_argument("version policy latest=" + std::to_string(policy.latest) +
                                ": serve at least the latest 1 version");
  for (int64_t v : policy.versions)
    if (v < 1) {
      std::vector<std::string> listed;
      for (int64_t w : policy.versions) listed.push_back(std::to_string(w));
      throw std::invalid_argument("version policy versions=[" + join(listed, ", ") +
                                  "]: versions are positive integers");
    }
  return policy;
}

std::vector<int64_t> VersionPolicy::select(std::vector<int64_t> available) const {
  std::sort(available.begin(), available.end());
  if (!versions.empty()) {
    std::vector<int64_t> chosen;
    for (int64_t v : available)
      if (std::find(versions.begin(), versions.end(), v) != versions.end()) chosen.push_back(v);
    return chosen;
  }
  const size_t keep = std::min(available.size(), static_cast<size_t>(latest));
  return std::vector<int64_t>(available.end() - static_cast<std::ptrdiff_t>(keep), available.end());
}

std::string VersionPolicy::describe() const {
  std::vector<std::string> listed;
  for (int64_t v : versions) listed.push_back(std::to_string(v));
  std::string tuple = "(" + join(listed, ", ") + (listed.size() == 1 ? ",)" : ")");
  return "VersionPolicy(latest=" + std::to_string(latest) + ", versions=" + tuple + ")";
}

// ------------------------------------------------------------------------------------------------ ServedVersion
void ServedVersion::flush() const {
  for (Batcher* b : {lookups.get(), predictions.get(), both.get()})
    if (b != nullptr) b->flush();
}

int64_t ServedVersion::held() const {
  int64_t held = 0;
  for (const Batcher* b : {lookups.get(), predictions.get(), both.get()})
    if (b != nullptr) held += b->held();
  return held;
}

size_t ServedVersion::depth() const {
  size_t depth = 0;
  for (const Batcher* b : {lookups.get(), predictions.get(), both.get()})
    if (b != nullptr) depth += b->depth();
  return depth;
}

void release_in_background(ServedVersion* version) {
  static std::mutex mutex;
  static std::condition_variable queued;
  static std::deque<ServedVersion*> pending;
  static std::once_flag started;
  std::call_once(started, [] {
    std::thread([] {
      setpriority(PRIO_PROCESS, static_cast<int>(syscall(SYS_gettid)), 19);
      for (;;) {
        ServedVersion* next = nullptr;
        {
          std::unique_lock<std::mutex> lock(mutex);
          queued.wait(lock, [] { return !pending.empty(); });
          next = pending.front();
          pending.pop_front();
        }
        const std::string what = "model " + next->name + " version " + next->version;
        const bool served = next->runner != nullptr;
        delete next;  // its batchers' threads joined, then its runner: the model's files are unmapped
        if (served) log("INFO", what + " freed (its last call returned)");
      }
    }).detach();  // lives as long as the process (which leaves with _exit)
  });
  {
    std::lock_guard<std::mutex> lock(mutex);
    pending.push_back(version);
  }
  queued.notify_one();
}

// ------------------------------------------------------------------------------------------------ ModelSet
ModelSet::ModelSet(std::shared_ptr<ServedVersion> model) {
  v1_model_ = model->name;
  models_[model->name][1] = std::move(model);
}

ModelSet::ModelSet(std::string root, VersionPolicy policy, VersionLoader loader, Metrics* metrics)
    : root_(std::move(root)), policy_(std::move(policy)), loader_(std::move(loader)), metrics_(metrics) {
  while (root_.size() > 1 && root_.back() == '/') root_.pop_back();
}

ModelSet::~ModelSet() {
  {
    std::lock_guard<std::mutex> lock(poll_mutex_);
    stopping_ = true;
  }
  poll_wake_.notify_all();
  if (poller_.joinable()) poller_.join();
}

std::vector<std::string> ModelSet::model_names() const {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root_, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory(error) && !name.empty() && name[0] != '.') names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<int64_t> ModelSet::available_versions(const std::string& name) const {
  std::vector<int64_t> found;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root_ + "/" + name, error)) {
    int64_t v = 0;
    if (entry.is_directory(error) && version_number(entry.path().filename().string(), v) && v > 0)
      found.push_back(v);
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::string ModelSet::for_client(const std::string& message) const {
  // paths inside the repository, not the server's file system
  std::string out = message;
  const std::string prefix = root_ + "/";
  for (size_t at = out.find(prefix); at != std::string::npos; at = out.find(prefix, at)) out.erase(at, prefix.size());
  return out;
}

std::shared_ptr<ServedVersion> ModelSet::find(const std::string& name, const std::string& version) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto model = models_.find(name);
  if (!is_repository()) {
    const auto& only = models_.begin()->second.begin()->second;
    if (model == models_.end())
      throw ModelSetError(Code::NotFound, "unknown model " + py_repr(name) + "; this server serves " +
                                              py_list({only->name}), "not_found");
    if (!version.empty() && version != "1")
      throw ModelSetError(Code::NotFound, "model " + py_repr(name) + " has no version " + py_repr(version) +
                                              "; its versions are ['1']", "not_found");
    return only;
  }
  if (model == models_.end() || model->second.empty()) {
    std::vector<std::string> names;
    for (const auto& [n, versions] : models_)
      if (!versions.empty()) names.push_back(n);
    throw ModelSetError(Code::NotFound, "unknown model " + py_repr(name) + "; this server serves " + py_list(names),
                        "not_found");
  }
  const Versions& versions = model->second;
  if (version.empty()) return versions.rbegin()->second;
  int64_t number = 0;
  if (version_number(version, number) && std::to_string(number) == version) {
    auto found = versions.find(number);
    if (found != versions.end()) return found->second;
  }
  std::string reason;
  if (auto failed = failed_.find({name, number}); failed != failed_.end() && std::to_string(number) == version)
    reason = " (it failed to load: " + failed->second.why + ")";
  std::vector<std::string> listed;
  for (const auto& [v, _] : versions) listed.push_back(std::to_string(v));
  throw ModelSetError(Code::NotFound, "model " + py_repr(name) + " has no version " + py_repr(version) + " loaded" +
                                          reason + "; its versions are " + py_list(listed), "not_found");
}

std::shared_ptr<ServedVersion> ModelSet::v1_target(const std::string& name, const std::string& version) const {
  std::string model;
  if (name.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    model = v1_model_;
  }
  return find(name.empty() ? model : name, version);
}

std::vector<std::string> ModelSet::versions(const std::string& name) const {
  find(name, "");  // NotFound in find's words
  std::lock_guard<std::mutex> lock(mutex_);
  if (!is_repository()) return {"1"};
  std::vector<std::string> listed;
  if (auto model = models_.find(name); model != models_.end())  // (unloaded since: none)
    for (const auto& [v, _] : model->second) listed.push_back(std::to_string(v));
  return listed;
}

std::vector<std::shared_ptr<ServedVersion>> ModelSet::served() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<ServedVersion>> all;
  for (const auto& [_, versions] : models_)
    for (const auto& [__, version] : versions) all.push_back(version);
  return all;
}

std::map<std::string, std::string> ModelSet::failures(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<std::string, std::string> found;
  for (const auto& [key, failed] : failed_)
    if (key.first == name) found[std::to_string(key.second)] = failed.why;
  return found;
}

bool ModelSet::ready(const std::string& name, const std::string& version) const {
  try {
    find(name, version);
    return true;
  } catch (const ModelSetError&) {
    return false;
  }
}

std::vector<IndexEntry> ModelSet::index(bool ready_only) const {
  if (!is_repository()) return {{models_.begin()->first, "1", "READY", ""}};
  std::vector<std::string> names = model_names();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [name, _] : models_) names.push_back(name);
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  std::vector<IndexEntry> entries;
  for (const auto& name : names) {
    auto model = models_.find(name);
    const bool loaded = model != models_.end() && !model->second.empty();
    if (loaded)
      for (const auto& [v, _] : model->second) entries.push_back({name, std::to_string(v), "READY", ""});
    if (ready_only) continue;
    bool failed_any = false;
    for (const auto& [key, failed] : failed_) {
      if (key.first != name || (loaded && model->second.count(key.second))) continue;
      entries.push_back({name, std::to_string(key.second), "UNAVAILABLE", for_client(failed.why)});
      failed_any = true;
    }
    if (!loaded && !failed_any)
      entries.push_back({name, "", "UNAVAILABLE", "not loaded (load it with RepositoryModelLoad)"});
  }
  return entries;
}

void ModelSet::retire(std::shared_ptr<ServedVersion> version, const char* why) const {
  // the calls still queued on it run now instead of waiting for company; the version goes with its last holder
  version->flush();
  log("INFO", "model " + version->name + " version " + version->version + " retired (" + why +
                  "); it is freed when its last call returns");
}

void ModelSet::load_all() {
  {
    std::lock_guard<std::mutex> lock(sync_mutex_);
    for (const auto& name : model_names()) sync(name, false);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [name, versions] : models_)
    if (!versions.empty()) {
      v1_model_ = name;  // embserve.v1 serves the first model by name
      return;
    }
  std::vector<std::string> failures;
  for (const auto& [key, failed] : failed_)
    failures.push_back(key.first + "/" + std::to_string(key.second) + ": " + failed.why);
  const std::vector<std::string> names = model_names();
  throw std::runtime_error("model repository " + root_ + " has no loadable model: looked for " + root_ +
                           "/<model>/<version>/manifest.json (model folders: " +
                           (names.empty() ? std::string("none") : clip_names(names)) + ") and found " +
                           (failures.empty() ? std::string("no version folder")
                                             : "none that loads; failures: " + join(failures, "; ")) +
                           "; " + root_ + "/manifest.json is missing too, so it is not one artifact either");
}

void ModelSet::poll_once() {
  std::lock_guard<std::mutex> lock(sync_mutex_);
  for (const auto& name : model_names()) sync(name, false);
}

void ModelSet::start_polling(double seconds) {
  if (!is_repository() || seconds <= 0) return;
  poller_ = std::thread([this, seconds] {
    std::unique_lock<std::mutex> lock(poll_mutex_);
    while (!poll_wake_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return stopping_; })) {
      lock.unlock();
      try {
        poll_once();
      } catch (const std::exception& err) {  // a poll that fails must not stop the next one
        log("ERROR", std::string("repository poll failed: ") + err.what());
      }
      lock.lock();
    }
  });
}

void ModelSet::load(const std::string& name) {
  if (!is_repository()) {
    find(name, "");  // already loaded: loading it again is a no-op, as in Triton
    return;
  }
  if (name.empty() || name.find('/') != std::string::npos || name[0] == '.')
    throw ModelSetError(Code::InvalidArgument, "model name " + py_repr(name) + " is not a folder name", "invalid");
  std::error_code error;
  if (!fs::is_directory(root_ + "/" + name, error))
    throw ModelSetError(Code::NotFound, "the repository " + root_ + " has no model folder " + py_repr(name),
                        "not_found");
  std::lock_guard<std::mutex> lock(sync_mutex_);
  sync(name, true);
}

void ModelSet::unload(const std::string& name) {
  if (!is_repository()) {
    find(name, "");
    throw ModelSetError(Code::FailedPrecondition,
                        "this server serves one artifact; start it on a repository (REPO/<model>/<version>/) to "
                        "unload models",
                        "unsupported");
  }
  std::lock_guard<std::mutex> sync_lock(sync_mutex_);
  find(name, "");
  Versions gone;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> others;
    for (const auto& [n, versions] : models_)
      if (n != name && !versions.empty()) others.push_back(n);
    if (others.empty())
      throw ModelSetError(Code::FailedPrecondition,
                          "model " + py_repr(name) +
                              " is the only model this server serves; load another model before unloading it",
                          "last_model");
    gone = std::move(models_[name]);
    models_.erase(name);
    if (v1_model_ == name) {
      v1_model_ = others[0];
      log("INFO", "embserve.v1 now serves model " + others[0] + " by default (" + name + " was unloaded)");
    }
  }
  for (auto& [_, version] : gone) retire(std::move(version), "unloaded");
}

// server/repository.py Repository._sync: bring `name` in line with its folder and the policy
void ModelSet::sync(const std::string& name, bool explicit_load) {
  const std::vector<int64_t> wanted = policy_.select(available_versions(name));
  if (explicit_load && wanted.empty())
    throw ModelSetError(Code::FailedPrecondition,
                        "model " + py_repr(name) + " has no version the policy " + policy_.describe() +
                            " selects; add " + name + "/<version>/ folders",
                        "load_failed");
  auto is_loaded = [&](int64_t v) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto model = models_.find(name);
    return model != models_.end() && model->second.count(v) > 0;
  };
  auto try_load = [&](int64_t v, std::string& why) -> std::shared_ptr<ServedVersion> {
    const std::string folder = root_ + "/" + name + "/" + std::to_string(v);
    const auto folder_signature = signature(folder);
    // the load and warm-up on one core (this thread and the checksum threads it starts, which inherit it; the
    // loader hashes on as many threads as the caller's affinity allows): the versions serving meanwhile keep the
    // other cores. At normal priority: at nice 19 on a busy host the starved loader held what the serving threads
    // wait on (the address space's lock while its hash threads fault the new weights in, malloc arenas) the longer,
    // and bench/soak.py --swap --native measured p99 during swaps / steady 2.6-4.7 (median 3.6) at nice 19 against
    // 1.0-1.7 (median 1.5) at nice 0, five runs each, interleaved, load 7-14
    cpu_set_t allowed;
    bool pinned = sched_getaffinity(0, sizeof(allowed), &allowed) == 0 && CPU_COUNT(&allowed) > 1;
    if (pinned) {
      cpu_set_t one;
      CPU_ZERO(&one);
      for (int cpu = CPU_SETSIZE - 1; cpu >= 0; --cpu)
        if (CPU_ISSET(cpu, &allowed)) {
          CPU_SET(cpu, &one);
          break;
        }
      pinned = sched_setaffinity(0, sizeof(one), &one) == 0;
    }
    struct Restore {
      bool pinned;
      cpu_set_t allowed;
      ~Restore() {
        if (pinned) sched_setaffinity(0, sizeof(allowed), &allowed);
      }
    } restore{pinned, allowed};
    try {
      const int64_t needed = artifact_bytes(folder), available = available_memory_bytes();
      if (available >= 0 && needed > available)
        throw RunnerError("model " + py_repr(name) + " version " + std::to_string(v) + " needs about " +
                              std::to_string(needed >> 20) + " MiB (" + folder + ") but only " +
                              std::to_string(available >> 20) +
                              " MiB are free beside the loaded versions; free memory, unload a version or narrow "
                              "the version policy",
                          "LoadError");
      auto version = loader_(folder, name, std::to_string(v));
      std::lock_guard<std::mutex> lock(mutex_);
      failed_.erase({name, v});
      return version;
    } catch (const std::exception& err) {
      why = describe_failure(err);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        failed_[{name, v}] = {folder_signature, why};
      }
      if (metrics_ != nullptr) metrics_->call("model load", "FAILED", 0.0);
      log("ERROR", "model " + name + " version " + std::to_string(v) +
                       " failed to load; the loaded versions keep serving: " + why);
      return nullptr;
    }
  };
  std::vector<std::string> errors;
  for (int64_t v : wanted) {
    if (is_loaded(v)) continue;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto failed = failed_.find({name, v});
      if (failed != failed_.end() && !explicit_load &&
          failed->second.signature == signature(root_ + "/" + name + "/" + std::to_string(v)))
        continue;  // already reported; retried once the folder changes (or on an explicit load)
    }
    std::string why;
    auto version = try_load(v, why);
    if (!version) {
      errors.push_back("version " + std::to_string(v) + ": " + why);
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      models_[name][v] = std::move(version);  // the swap: new calls find it from here on
    }
    if (metrics_ != nullptr) metrics_->call("model load", "OK", 0.0);
    log("INFO", "model " + name + " version " + std::to_string(v) + " is serving");
  }
  bool empty = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto model = models_.find(name);
    empty = model == models_.end() || model->second.empty();
  }
  if (empty && policy_.versions.empty()) {
    // nothing of this model serves (the newest versions failed at start): fall back to older ones
    const auto available = available_versions(name);
    for (auto older = available.rbegin(); older != available.rend(); ++older) {
      bool skip = std::find(wanted.begin(), wanted.end(), *older) != wanted.end();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        skip = skip || failed_.count({name, *older}) > 0;
      }
      if (skip) continue;
      std::string why;
      auto version = try_load(*older, why);
      if (!version) continue;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        models_[name][*older] = std::move(version);
      }
      log("WARNING", "model " + name + " serves version " + std::to_string(*older) +
                         ": the newer versions failed to load");
      break;
    }
  }
  // versions the policy no longer selects go once a selected one serves (never leave a model empty)
  std::vector<std::shared_ptr<ServedVersion>> stale;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto model = models_.find(name);
    if (model != models_.end()) {
      Versions& serving = model->second;
      bool any_wanted = false;
      for (int64_t v : wanted) any_wanted = any_wanted || serving.count(v) > 0;
      if (any_wanted)
        for (auto it = serving.begin(); it != serving.end();) {
          if (std::find(wanted.begin(), wanted.end(), it->first) == wanted.end()) {
            stale.push_back(std::move(it->second));
            it = serving.erase(it);
          } else {
            ++it;
          }
        }
    }
  }
  for (auto& version : stale) retire(std::move(version), ("policy " + policy_.describe()).c_str());
  if (explicit_load && !errors.empty())
    throw ModelSetError(Code::FailedPrecondition, for_client("model " + py_repr(name) + ": " + join(errors, "; ")),
                        "load_failed");
}

// Under the lock, without copying a reference: these run on forward threads too (the overlap rule), where
// dropping the last reference of a retired version would join the thread from itself.
void ModelSet::flush() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [_, versions] : models_)
    for (const auto& [__, version] : versions) version->flush();
}

int64_t ModelSet::held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t held = 0;
  for (const auto& [_, versions] : models_)
    for (const auto& [__, version] : versions) held += version->held();
  return held;
}

double ModelSet::depth() const {
  std::lock_guard<std::mutex> lock(mutex_);
  double depth = 0;
  for (const auto& [_, versions] : models_)
    for (const auto& [__, version] : versions) depth += static_cast<double>(version->depth());
  return depth;
}

}  // namespace embserve::server
