// embserve::Model: manifest checks, fbgemm library loading, TorchScript load and validated lookups.
#include "embserve/loader.h"

#include <dlfcn.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/script.h>

#ifndef EMBSERVE_FBGEMM_DIR
#define EMBSERVE_FBGEMM_DIR ""
#endif

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace embserve {
namespace {

constexpr const char* kFormat = "embserve-artifact";
constexpr int kFormatVersion = 2;
constexpr std::uintmax_t kMaxManifestBytes = 16u * 1024u * 1024u;
constexpr const char* kRequestPrefix = "embserve.RequestError: ";

std::string first_line(const std::string& text) {
  auto end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

std::string sha256_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ChecksumError(path.string() + " cannot be opened");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1)
    throw ChecksumError("OpenSSL cannot compute sha256 for " + path.string());
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    if (in.gcount() > 0) EVP_DigestUpdate(ctx.get(), buffer.data(), static_cast<size_t>(in.gcount()));
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &size);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < size; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

json read_manifest(const fs::path& folder) {
  fs::path path = folder / "manifest.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw ManifestError(path.string() + " is missing; " + folder.string() + " is not an embserve artifact");
  auto size = fs::file_size(path, ec);
  if (size > kMaxManifestBytes)
    throw ManifestError(path.string() + " is " + std::to_string(size) + " bytes, over the 16 MiB cap");
  std::ifstream in(path, std::ios::binary);
  json data;
  try {
    data = json::parse(in);
  } catch (const json::exception& err) {
    throw ManifestError(path.string() + " is not valid JSON (" + err.what() + "); the file is corrupted");
  }
  if (!data.is_object()) throw ManifestError(path.string() + " is not a JSON object");
  auto format = data.value("format", json());
  if (!format.is_string() || format.get<std::string>() != kFormat)
    throw ManifestError(path.string() + " is not an embserve manifest (format=" + format.dump() + ")");
  auto version = data.value("format_version", json());
  if (!version.is_number_integer() || version.get<int>() != kFormatVersion)
    throw ManifestError(path.string() + " has format_version " + version.dump() + "; this loader reads version " +
                        std::to_string(kFormatVersion) + ". Re-export the model with a matching embserve");
  return data;
}

void verify_files(const fs::path& folder, const json& files, const std::string& model_file) {
  if (!files.is_object() || !files.contains(model_file))
    throw ChecksumError("manifest.json has no checksum for " + model_file);
  for (const auto& [name, entry] : files.items()) {
    if (name.empty() || fs::path(name).filename().string() != name || name == "." || name == "..")
      throw ChecksumError("manifest.json lists a file outside the artifact: '" + name + "'");
    fs::path path = folder / name;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) throw ChecksumError(path.string() + " is missing from the artifact");
    auto expected_bytes = entry.at("bytes").get<std::uintmax_t>();
    auto expected_sha = entry.at("sha256").get<std::string>();
    auto size = fs::file_size(path, ec);
    if (size != expected_bytes)
      throw ChecksumError(path.string() + " is " + std::to_string(size) + " bytes but the manifest says " +
                          std::to_string(expected_bytes) + "; the file is truncated or corrupted");
    auto digest = sha256_file(path);
    if (digest != expected_sha)
      throw ChecksumError(path.string() + " fails its sha256 check (" + digest.substr(0, 12) +
                          "... != " + expected_sha.substr(0, 12) + "...); the file is corrupted");
  }
}

// dlopen'ed libraries stay loaded for the life of the process; loading is serialised.
std::mutex& library_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::vector<std::string> load_libraries(const std::vector<std::string>& names, const std::vector<std::string>& dirs) {
  std::lock_guard<std::mutex> lock(library_mutex());
  std::vector<std::string> loaded;
  for (const auto& name : names) {
    if (name.empty() || fs::path(name).filename().string() != name)
      throw LibraryError("manifest.json lists an fbgemm library that is not a plain file name: '" + name + "'");
    std::string found;
    for (const auto& dir : dirs) {
      std::error_code ec;
      if (fs::is_regular_file(fs::path(dir) / name, ec)) {
        found = fs::absolute(fs::path(dir) / name).string();
        break;
      }
    }
    if (found.empty()) {
      std::ostringstream searched;
      for (size_t i = 0; i < dirs.size(); ++i) searched << (i ? ", " : "") << dirs[i];
      throw LibraryError("fbgemm library " + name + " not found; searched: [" + searched.str() +
                         "] (LoadOptions.library_dirs, $EMBSERVE_FBGEMM_LIB_DIR, the manifest's fbgemm.build_dir, "
                         "the fbgemm_gpu folder embserve_loader was built with)");
    }
    if (dlopen(found.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* reason = dlerror();
      throw LibraryError("cannot load fbgemm library " + found + ": " + (reason ? reason : "unknown dlopen error"));
    }
    loaded.push_back(found);
  }
  return loaded;
}

// Turn an error from the TorchScript interpreter into a typed one.
[[noreturn]] void rethrow_script_error(const std::exception& err) {
  std::string text = err.what();
  auto at = text.rfind(kRequestPrefix);
  if (at != std::string::npos) throw RequestError(first_line(text.substr(at + std::string(kRequestPrefix).size())));
  throw ModelError("the model failed: " + text);
}

}  // namespace

Model Model::load(const std::string& artifact_dir, const LoadOptions& options) {
  fs::path folder(artifact_dir);
  std::error_code ec;
  if (!fs::is_directory(folder, ec))
    throw ManifestError(artifact_dir + " is not a folder; pass the artifact folder written by export");
  json data = read_manifest(folder);
  Model model;
  model.path_ = artifact_dir;
  std::vector<std::string> libraries;
  std::string build_dir, model_file;
  std::vector<std::string> devices;
  try {
    model_file = data.at("model_file").get<std::string>();
    for (const auto& f : data.at("features")) {
      FeatureInfo info;
      info.name = f.at("name").get<std::string>();
      info.table = f.at("table").get<std::string>();
      info.num_embeddings = f.at("num_embeddings").get<int64_t>();
      info.embedding_dim = f.at("embedding_dim").get<int64_t>();
      info.pooling = f.value("pooling", std::string("sum"));
      info.column_start = f.at("column_start").get<int64_t>();
      info.column_end = f.at("column_end").get<int64_t>();
      model.output_dim_ = std::max(model.output_dim_, info.column_end);
      model.features_.push_back(std::move(info));
    }
    libraries = data.at("fbgemm").at("libraries").get<std::vector<std::string>>();
    build_dir = data.at("fbgemm").value("build_dir", std::string());
    if (data.contains("devices")) devices = data.at("devices").get<std::vector<std::string>>();
    if (data.contains("sharding") && data.at("sharding").is_object())
      model.world_size_ = data.at("sharding").value("world_size", 1);
    if (model.features_.empty()) throw ManifestError("manifest.json lists no features");
    if (fs::path(model_file).filename().string() != model_file)
      throw ManifestError("manifest.json names a model file outside the artifact: '" + model_file + "'");
    if (options.verify_checksums) verify_files(folder, data.at("files"), model_file);
  } catch (const json::exception& err) {
    throw ManifestError((folder / "manifest.json").string() + " is malformed: " + err.what());
  }
  for (const auto& device : devices) {
    if (device.rfind("cuda", 0) == 0 && !torch::cuda::is_available())
      throw ModelError(artifact_dir + " was exported for device " + device +
                       " and this host (or this libtorch) has no CUDA device");
  }

  std::vector<std::string> dirs = options.library_dirs;
  if (const char* env = std::getenv("EMBSERVE_FBGEMM_LIB_DIR"); env && *env) dirs.emplace_back(env);
  if (!build_dir.empty()) dirs.push_back(build_dir);
  if (std::string(EMBSERVE_FBGEMM_DIR).size()) dirs.emplace_back(EMBSERVE_FBGEMM_DIR);
  model.libraries_ = load_libraries(libraries, dirs);

  fs::path model_path = folder / model_file;
  try {
    model.module_ = std::make_shared<torch::jit::Module>(torch::jit::load(model_path.string()));
    model.module_->eval();
  } catch (const std::exception& err) {
    throw ModelError(model_path.string() + " cannot be loaded by TorchScript: " + first_line(err.what()) +
                     " (are the fbgemm libraries in the manifest's fbgemm.libraries the ones it was exported with?)");
  }

  int threads = options.intra_op_threads;
  if (threads < 0 && model.world_size_ >= 2) {
    bool all_cpu = std::all_of(devices.begin(), devices.end(), [](const std::string& d) { return d == "cpu"; });
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    if (all_cpu) threads = std::max(1, static_cast<int>(cores) / model.world_size_);
  }
  if (threads > 0) at::set_num_threads(threads);
  return model;
}

std::vector<std::string> Model::feature_names() const {
  std::vector<std::string> names;
  for (const auto& f : features_) names.push_back(f.name);
  return names;
}

// The request rules. Every sentence below is worded exactly as in infer/request_rules.py (Python, TorchScript
// and the server use that module); tests/support/bad_requests.py holds all entry points to the same fragments.
namespace {
template <typename T>
void check_lengths(const at::Tensor& lengths, const std::vector<FeatureInfo>& features, int64_t batch,
                   int64_t num_ids, std::vector<int64_t>& per_feature) {
  const T* data = lengths.data_ptr<T>();
  int64_t total = 0;
  for (int64_t i = 0; i < lengths.numel(); ++i) {
    if (data[i] < 0)
      throw RequestError("feature '" + features[static_cast<size_t>(i / batch)].name + "': bag " +
                         std::to_string(i % batch) + " has negative length " + std::to_string(data[i]));
    if (static_cast<int64_t>(data[i]) > num_ids)  // before summing: huge lengths could wrap the sum around
      throw RequestError("feature '" + features[static_cast<size_t>(i / batch)].name + "': bag " +
                         std::to_string(i % batch) + " has length " + std::to_string(data[i]) +
                         " but the batch has only " + std::to_string(num_ids) + " ids");
    per_feature[static_cast<size_t>(i / batch)] += data[i];
    total += data[i];
  }
  if (total != num_ids)
    throw RequestError("lengths sum to " + std::to_string(total) + " but there are " + std::to_string(num_ids) +
                       " ids; lengths must add up to the number of ids");
}

template <typename T>
void check_ids(const at::Tensor& values, const std::vector<FeatureInfo>& features,
               const std::vector<int64_t>& per_feature) {
  const T* data = values.data_ptr<T>();
  int64_t start = 0;
  for (size_t f = 0; f < features.size(); ++f) {
    const int64_t rows = features[f].num_embeddings;
    const int64_t end = start + per_feature[f];
    for (int64_t i = start; i < end; ++i) {
      const int64_t id = static_cast<int64_t>(data[i]);
      if (id < 0 || id >= rows)
        throw RequestError("feature '" + features[f].name + "': id " + std::to_string(id) + " is out of range [0, " +
                           std::to_string(rows) + ") (id #" + std::to_string(i - start) + " of the feature)");
    }
    start = end;
  }
}
}  // namespace

void Model::validate(const at::Tensor& values, const at::Tensor& lengths,
                     const std::optional<at::Tensor>& weights) const {
  if (!values.defined() || values.dim() != 1 ||
      (values.scalar_type() != at::kLong && values.scalar_type() != at::kInt))
    throw RequestError("values must be a 1-D int64 or int32 tensor of ids");
  if (!lengths.defined() || lengths.dim() != 1 ||
      (lengths.scalar_type() != at::kInt && lengths.scalar_type() != at::kLong))
    throw RequestError("lengths must be a 1-D int32 (or int64) tensor");
  if (!values.device().is_cpu() || !lengths.device().is_cpu())
    throw RequestError("values and lengths must be CPU tensors");
  const int64_t num_features = static_cast<int64_t>(features_.size());
  if (lengths.numel() % num_features != 0)
    throw RequestError("lengths has " + std::to_string(lengths.numel()) + " entries, not a multiple of the " +
                       std::to_string(num_features) + " features; features have inconsistent batch sizes");
  const int64_t batch = lengths.numel() / num_features;
  std::vector<int64_t> per_feature(features_.size(), 0);
  at::Tensor lengths_c = lengths.contiguous();
  if (lengths_c.scalar_type() == at::kInt)
    check_lengths<int32_t>(lengths_c, features_, batch, values.numel(), per_feature);
  else
    check_lengths<int64_t>(lengths_c, features_, batch, values.numel(), per_feature);
  if (weights.has_value() && weights->defined()) {
    const auto& w = *weights;
    if (w.dim() != 1 || w.scalar_type() != at::kFloat || !w.device().is_cpu())
      throw RequestError("weights must be a 1-D float32 tensor with one weight per id");
    if (w.numel() != values.numel())
      throw RequestError("weights has " + std::to_string(w.numel()) + " entries but there are " +
                         std::to_string(values.numel()) + " ids; give one weight per id");
  }
  at::Tensor values_c = values.contiguous();
  if (values_c.scalar_type() == at::kInt)
    check_ids<int32_t>(values_c, features_, per_feature);
  else
    check_ids<int64_t>(values_c, features_, per_feature);
}

at::Tensor Model::lookup(const at::Tensor& values, const at::Tensor& lengths,
                         const std::optional<at::Tensor>& weights) const {
  validate(values, lengths, weights);
  c10::InferenceMode guard;
  std::vector<c10::IValue> inputs;
  inputs.reserve(3);
  inputs.emplace_back(values);
  inputs.emplace_back(lengths);
  if (weights.has_value() && weights->defined())
    inputs.emplace_back(*weights);
  else
    inputs.emplace_back(c10::IValue());
  try {
    return module_->forward(std::move(inputs)).toTensor();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    rethrow_script_error(err);
  }
}

}  // namespace embserve
