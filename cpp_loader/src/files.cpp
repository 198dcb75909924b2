// An artifact's files in C++: sizes and sha256 (whole, or chunks in parallel) and read-only mappings.
#include "files.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <ATen/Functions.h>

#include "embserve/loader.h"
#include "schema.h"

namespace fs = std::filesystem;

namespace embserve::files {
namespace {

std::string hex(const unsigned char* digest, unsigned int size) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < size; ++i) {
    out += digits[digest[i] >> 4];
    out += digits[digest[i] & 15];
  }
  return out;
}

// sha256 of `size` bytes in memory, hex; empty when OpenSSL fails (which then reads as a mismatch).
std::string sha256_bytes(const unsigned char* data, uint64_t size) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) return "";
  if (size > 0 && EVP_DigestUpdate(ctx.get(), data, size) != 1) return "";
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(ctx.get(), digest, &length) != 1) return "";
  return hex(digest, length);
}

std::string size_mismatch(const fs::path& path, uint64_t size, uint64_t expected) {
  return path.string() + " is " + std::to_string(size) + " bytes but the manifest says " + std::to_string(expected) +
         "; the file is truncated or corrupted";
}

}  // namespace

std::string sha256_hex(const void* data, uint64_t size) {
  return sha256_bytes(static_cast<const unsigned char*>(data), size);
}

int64_t page_round_up(int64_t value) { return (value + kPageBytes - 1) / kPageBytes * kPageBytes; }

unsigned usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

Mapping::Mapping(const fs::path& path, uint64_t expected_bytes) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw ChecksumError(path.string() + " is missing from the artifact");
    throw ChecksumError(path.string() + " cannot be opened: " + std::strerror(errno));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int err = errno;
    ::close(fd);
    throw ChecksumError(path.string() + " cannot be read: " + std::strerror(err));
  }
  const auto size = static_cast<uint64_t>(info.st_size);
  if (size != expected_bytes) {
    ::close(fd);
    throw ChecksumError(size_mismatch(path, size, expected_bytes));
  }
  if (size > 0) {
    void* data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (data == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw ChecksumError(path.string() + " cannot be mapped: " + std::strerror(err));
    }
    data_ = data;
    size_ = size;
  }
  ::close(fd);  // the mapping keeps the file
}

Mapping::~Mapping() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

at::Tensor mapped_tensor(const std::shared_ptr<Mapping>& mapping, int64_t offset, int64_t bytes) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  if (bytes == 0) return at::empty({0}, options);
  if (offset < 0 || bytes < 0 || static_cast<uint64_t>(offset + bytes) > mapping->size())
    throw ModelError(mapping->path().string() + ": bytes " + std::to_string(offset) + ".." +
                     std::to_string(offset + bytes) + " lie outside the " + std::to_string(mapping->size()) +
                     "-byte file");
  // from_blob never frees the data itself: the deleter's copy of `mapping` is dropped with the storage, and the
  // last holder's drop unmaps. The cast is safe as long as nobody writes (PROT_READ would fault).
  auto* first = const_cast<unsigned char*>(mapping->data()) + offset;
  return at::from_blob(first, {bytes}, [mapping](void*) {}, options);
}

std::shared_ptr<Mapping> Mappings::get(const std::string& name, uint64_t expected_bytes) {
  auto found = open_.find(name);
  if (found != open_.end()) return found->second;
  auto mapping = std::make_shared<Mapping>(folder_ / name, expected_bytes);
  open_.emplace(name, mapping);
  return mapping;
}

std::vector<ListedFile> check_listed_files(const fs::path& folder, const schema::Document& files,
                                           const std::string& model_file) {
  if (!files.is_object() || !files.contains(model_file))
    throw ChecksumError("manifest.json has no checksum for " + model_file);
  std::vector<ListedFile> listed;
  for (const auto& [name, entry] : files.items()) {
    if (name.empty() || fs::path(name).filename().string() != name || name == "." || name == "..")
      throw ChecksumError("manifest.json lists a file outside the artifact: '" + name + "'");
    ListedFile file;
    file.name = name;
    file.path = folder / name;
    file.bytes = entry.at("bytes").get<uint64_t>();
    file.sha256 = entry.at("sha256").get<std::string>();
    std::error_code ec;
    if (!fs::is_regular_file(file.path, ec)) throw ChecksumError(file.path.string() + " is missing from the artifact");
    const auto size = fs::file_size(file.path, ec);
    if (ec || size != file.bytes) throw ChecksumError(size_mismatch(file.path, ec ? 0 : size, file.bytes));
    if (entry.contains("chunks")) {  // as Python's start_verify: the count checked whatever the verify mode
      file.chunk_bytes = entry["chunks"]["bytes"].get<uint64_t>();  // >= 4096 (schema)
      file.chunk_sha256 = entry["chunks"]["sha256"].get<std::vector<std::string>>();
      const uint64_t expected = (size + file.chunk_bytes - 1) / file.chunk_bytes;
      if (file.chunk_sha256.size() != expected)
        throw ChecksumError("manifest.json lists " + std::to_string(file.chunk_sha256.size()) +
                            " chunk digests for " + file.path.string() + ", whose " + std::to_string(size) +
                            " bytes make " + std::to_string(expected) + " chunks of " +
                            std::to_string(file.chunk_bytes) + "; the manifest is corrupted");
    }
    listed.push_back(std::move(file));
  }
  return listed;
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
  return hex(digest, size);
}

void verify_whole(const ListedFile& file) {
  const auto digest = sha256_file(file.path);
  if (digest != file.sha256)
    throw ChecksumError(file.path.string() + " fails its sha256 check (" + digest.substr(0, 12) + "... != " +
                        file.sha256.substr(0, 12) + "...); the file is corrupted");
}

ChunkHashing::ChunkHashing(const std::vector<ListedFile>& files, Mappings& mappings) {
  for (const auto& file : files) {
    if (file.chunk_bytes == 0) continue;
    const size_t index = files_.size();
    files_.push_back(file);
    mappings_.push_back(mappings.get(file.name, file.bytes));
    for (uint64_t offset = 0; offset < file.bytes; offset += file.chunk_bytes)
      tasks_.push_back({index, offset, std::min(file.chunk_bytes, file.bytes - offset)});
  }
  digests_.resize(tasks_.size());
  const size_t threads = std::min<size_t>(usable_cores(), tasks_.size());
  for (size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

ChunkHashing::~ChunkHashing() {
  stop_ = true;
  join();
}

void ChunkHashing::work() {
  for (size_t t = next_.fetch_add(1); t < tasks_.size() && !stop_; t = next_.fetch_add(1)) {
    const Task& task = tasks_[t];
    digests_[t] = sha256_bytes(mappings_[task.file]->data() + task.offset, task.size);
  }
}

void ChunkHashing::join() {
  for (auto& worker : workers_)
    if (worker.joinable()) worker.join();
  workers_.clear();
}

void ChunkHashing::wait() {
  join();
  size_t t = 0;
  for (size_t f = 0; f < files_.size(); ++f) {
    const auto& file = files_[f];
    const size_t count = file.chunk_sha256.size();
    for (size_t chunk = 0; chunk < count; ++chunk, ++t) {
      const std::string& got = digests_[t];
      const std::string& want = file.chunk_sha256[chunk];
      if (got == want) continue;
      const uint64_t first = chunk * file.chunk_bytes;
      const uint64_t last = std::min(file.bytes, first + file.chunk_bytes) - 1;
      throw ChecksumError(file.path.string() + " fails its sha256 check in bytes " + std::to_string(first) + "-" +
                          std::to_string(last) + " (chunk " + std::to_string(chunk) + " of " +
                          std::to_string(count) + ": " + got.substr(0, 12) + "... != " + want.substr(0, 12) +
                          "...); the file is corrupted");
    }
  }
  mappings_.clear();  // the hashing's own hold; the kernels keep theirs
}

}  // namespace embserve::files
