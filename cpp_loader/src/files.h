// Where an artifact's bytes live: its listed files' sizes and sha256 (whole, or chunk by chunk on a pool of
// std::threads, overlapping the model's load), and read-only mappings of them (a version 3 artifact's weight
// files, handed to the kernels as uint8 tensors). The C++ side of infer/storage/ (checksums.py, mapping.py).
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Tensor.h>

#include "schema.h"

namespace embserve::files {

// infer/storage/layout.py PAGE_BYTES: every table of a weight file starts on a page boundary.
constexpr int64_t kPageBytes = 4096;

int64_t page_round_up(int64_t value);

// A read-only mapping of a whole file (PROT_READ, MAP_PRIVATE: never written, shared with every other process
// mapping it through the page cache); unmapped when the last holder lets go.
class Mapping {
 public:
  // Checks the file's size against `expected_bytes` before mapping (a mapping past the end of a file raises
  // SIGBUS on access): a missing file or another size is a ChecksumError naming it.
  Mapping(const std::filesystem::path& path, uint64_t expected_bytes);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  const unsigned char* data() const { return static_cast<const unsigned char*>(data_); }
  uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  void* data_ = nullptr;
  uint64_t size_ = 0;
};

// `bytes` bytes of the mapping from `offset` as a 1-D uint8 CPU tensor without a copy; the tensor (and every view
// of it) keeps the mapping alive. The mapping is read-only: the tensor must never be written (the kernels only
// read their weights).
at::Tensor mapped_tensor(const std::shared_ptr<Mapping>& mapping, int64_t offset, int64_t bytes);

// The files of one load, each mapped at most once (a weight file is hashed and handed to the kernels from one
// mapping).
class Mappings {
 public:
  explicit Mappings(std::filesystem::path folder) : folder_(std::move(folder)) {}
  std::shared_ptr<Mapping> get(const std::string& name, uint64_t expected_bytes);

 private:
  std::filesystem::path folder_;
  std::map<std::string, std::shared_ptr<Mapping>> open_;
};

// One listed file: its path, size, whole-file sha256 and, for a large file, its chunk digests.
struct ListedFile {
  std::string name;
  std::filesystem::path path;
  uint64_t bytes = 0;
  std::string sha256;
  uint64_t chunk_bytes = 0;  // 0: no chunk digests (the whole file is hashed)
  std::vector<std::string> chunk_sha256;
};

// Every file of the manifest's `files`, in manifest order, with its path and size checked (present, inside the
// artifact, the listed size, as many chunk digests as its size makes); ChecksumError naming the first bad one.
std::vector<ListedFile> check_listed_files(const std::filesystem::path& folder, const schema::Document& files,
                                           const std::string& model_file);

// sha256 of `size` bytes in memory, hex (empty when OpenSSL fails, which then reads as a mismatch).
std::string sha256_hex(const void* data, uint64_t size);

// sha256 of a whole file, hex; ChecksumError when it cannot be read.
std::string sha256_file(const std::filesystem::path& path);

// Compares a file without chunk digests with its whole-file sha256 now. ChecksumError naming it.
void verify_whole(const ListedFile& file);

// The chunks of the chunked files, hashed by a pool of threads (one per core) from read-only mappings, started at
// construction; wait() joins them and throws ChecksumError naming the file, byte range and chunk of the first
// chunk (in file then chunk order) that does not match. Destroying it unwaited stops the workers at their next
// chunk and joins them.
class ChunkHashing {
 public:
  ChunkHashing(const std::vector<ListedFile>& files, Mappings& mappings);
  ~ChunkHashing();
  ChunkHashing(const ChunkHashing&) = delete;
  ChunkHashing& operator=(const ChunkHashing&) = delete;
  void wait();

 private:
  struct Task {
    size_t file;
    uint64_t offset, size;
  };
  void work();
  void join();

  std::vector<ListedFile> files_;
  std::vector<std::shared_ptr<Mapping>> mappings_;
  std::vector<Task> tasks_;
  std::vector<std::string> digests_;  // per task
  std::atomic<size_t> next_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

// Threads a CPU-bound pool uses here: the cores this process may run on.
unsigned usable_cores();

}  // namespace embserve::files
