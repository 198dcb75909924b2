// embserve_run ARTIFACT [--requests FILE --out FILE]... [--fail-fast] [--bench N] [--library-dir DIR]... [--threads N]
//              [--kernel-threads N] [--backend torchscript|pt2]
//
// Runs the requests in FILE (written by infer.cpp_io.write_requests) and writes one record per request to --out
// (read by infer.cpp_io.read_responses). The method follows from each request: one that carries dense_features
// (request file version 2) is a predict, answered with the scores [batch] float32; one without is a lookup,
// answered with the pooled embeddings [batch, output_dim] float32. Every request of a file is answered: a bad one
// (refused by the call contract, or framed but unusable, e.g. values absent) gets a typed error record and a line on
// stderr, and the run goes on. Where a record's frame cannot be found (an unknown dtype, a size that is negative,
// overflows or points past the end of the file), nothing after it can be located: the requests before it are
// answered, and the response file's closing record names the request and byte where the framing broke.
// --fail-fast stops the run at the first request that fails (its error record is the file's last).
// --bench N times N lookups (cycling through the requests) after a warm-up and prints one JSON line with per-call
// latency and lookups (ids) per second (predict requests are timed as predicts).
// Exit status (also in --help): 0 every request of every file succeeded; 1 some request failed or a request file
// is broken after its header (see the response file), or the artifact cannot be loaded; 2 a usage error, a request
// file that cannot be read at all (cannot be opened, not a request file, an impossible count) or an --out that
// cannot be written. Every error is one line on stderr ("embserve_run: ..."), never a backtrace.
// --threads sets torch's intra-op threads; --kernel-threads how many example ranges each CPU kernel may split
// a batch into (LoadOptions::kernel_threads; default cores / CPU kernels, as Python's load).
// --verify full (default) checks every listed file's size and sha256 before the model is ready; none paths and sizes
// only (LoadOptions::verify). The load's seconds and GB/s (listed bytes / seconds) are printed after "loaded" and
// in --bench's JSON line.
// --backend picks the model file that runs: model.pt (torchscript, the default) or model.pt2 (pt2, an AOTInductor
// package; the artifact must be exported with `embserve export --pt2`).
// --unchecked answers through Model::lookup_unchecked / lookup_and_predict_unchecked, each request checked by
// Model::validate first (the entries a serving front end calls after its own checks).
// --load-each DIR... loads each folder in turn (a fresh Model each, with the same --library-dir/--verify/--backend
// options) and prints one line per folder on stdout: "DIR: ok", or "DIR: KIND: MESSAGE", the words the one-folder
// run prints after "embserve_run: " on stderr. With --requests FILE (no --out; every request must be readable) each
// loaded model answers every request, and the first that fails is the folder's outcome: "DIR: request I: KIND:
// MESSAGE". Exit status 1 when any folder failed, else 0. It saves a process start (loading libtorch) per folder
// where only each folder's outcome matters (the tests' tampered copies).
// File format: see infer/artifact/cpp_io.py (request files EMBSRQ01 and EMBSRQ02, response files EMBSRS02).
#include <embserve/loader.h>

#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

// Version 1: values, lengths, weights per request; version 2 adds dense_features (absent: a lookup).
constexpr char kRequestMagicV1[8] = {'E', 'M', 'B', 'S', 'R', 'Q', '0', '1'};
constexpr char kRequestMagicV2[8] = {'E', 'M', 'B', 'S', 'R', 'Q', '0', '2'};
// Version 2: the request count, the records of the requests read, then a closing record (cpp_io.py).
constexpr char kResponseMagic[8] = {'E', 'M', 'B', 'S', 'R', 'S', '0', '2'};
constexpr uint8_t kResult = 0, kError = 1, kEndWhole = 2, kEndWithError = 3;
constexpr int kMaxDims = 8;
// The smallest request record: values and lengths each a dtype code and ndim 0, weights absent (version 2:
// dense_features absent too).
constexpr uint64_t kMinRequestBytes = 5;
// Messages echoed on stderr and into the response file are cut to this many bytes.
constexpr size_t kMaxMessageBytes = 1024;
// The kind of every error found in a request file's bytes (Python: infer.errors.FileFormatError).
const std::string kFileFormatError = "FileFormatError";
// The kind of the requests --fail-fast leaves unrun.
const std::string kNotRun = "NotRun";

// What each exit status means; main returns the worst one met.
enum Status : int { kAllOk = 0, kSomeFailed = 1, kCannotRun = 2 };

struct Request {
  at::Tensor values, lengths;
  std::optional<at::Tensor> weights;
  std::optional<at::Tensor> dense_features;  // present: a predict request
};

// A request as read from its file: the tensors, or why a well-framed request cannot run (refusal set).
struct ReadRequest {
  Request request;
  std::string refusal;
};

// A request file as far as it could be read.
struct RequestFile {
  uint32_t declared = 0;              // the count in its header (0: the header cannot be read)
  std::vector<ReadRequest> requests;  // every request read, in order: all `declared` unless the framing broke
  std::string problem;                // the file's own problem (header, framing, trailing bytes); empty: none
  bool header_ok = false;             // false: nothing could be read (exit status 2)
};

// --unchecked: answer through the loader's unchecked entries, each request checked first by Model::validate (as a
// serving front end checks every request before them)
bool unchecked_entries = false;

// A request's answer: the scores of a predict request, else the pooled lookups.
at::Tensor answer(const embserve::Model& model, const Request& r) {
  if (unchecked_entries) {
    model.validate(r.values, r.lengths, r.weights);
    if (r.dense_features)
      return model.lookup_and_predict_unchecked(*r.dense_features, r.values, r.lengths, r.weights).second;
    return model.lookup_unchecked(r.values, r.lengths, r.weights);
  }
  if (r.dense_features) return model.predict(*r.dense_features, r.values, r.lengths, r.weights);
  return model.lookup(r.values, r.lengths, r.weights);
}

// The file cannot be read at all: it cannot be opened, is not a request file, or its header is impossible.
class FileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A record whose frame cannot be found (an unknown dtype, a size that is negative, overflows or points past
// the end, a truncated header): nothing after it can be located.
class FramingError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One line, bounded: newlines and control bytes blanked, cut at kMaxMessageBytes (not inside a UTF-8 char).
std::string bounded(std::string text) {
  for (char& c : text)
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  if (text.size() > kMaxMessageBytes) {
    size_t cut = kMaxMessageBytes;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
    text = text.substr(0, cut) + "...(" + std::to_string(text.size()) + " bytes)";
  }
  return text;
}

// An exception's message as one bounded line, without c10's backtrace.
std::string one_line(const std::exception& err) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&err)) return bounded(c10_error->what_without_backtrace());
  return bounded(err.what());
}

// The whole request file in memory, read with every size checked against the bytes left.
class Reader {
 public:
  explicit Reader(std::vector<char> data) : data_(std::move(data)) {}
  uint64_t left() const { return data_.size() - at_; }
  uint64_t offset() const { return at_; }

  template <typename T>
  T pod(const char* what) {
    if (left() < sizeof(T))
      throw FramingError("the file ends at byte " + std::to_string(data_.size()) + " inside " + what);
    T value{};
    std::memcpy(&value, data_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }

  // The next `bytes` bytes; callers check them against left() first.
  const char* take(uint64_t bytes) {
    const char* start = data_.data() + at_;
    at_ += bytes;
    return start;
  }

 private:
  std::vector<char> data_;
  uint64_t at_ = 0;
};

template <typename T>
void write_pod(std::ostream& out, T value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(T));
}

// One tensor record located in the file: its dtype, shape and data, not yet copied.
struct TensorRecord {
  bool present = false;
  at::ScalarType type = at::kFloat;
  std::vector<int64_t> shape;
  const char* data = nullptr;
  uint64_t bytes = 0;
};

// Locates one tensor record, every size checked before it is used; FramingError when its frame cannot be found.
TensorRecord read_record(Reader& in, const std::string& name) {
  TensorRecord record;
  const auto code = in.pod<uint8_t>(("the dtype code of " + name).c_str());
  if (code == 0) return record;
  uint64_t itemsize = 0;
  switch (code) {
    case 1: record.type = at::kInt; itemsize = 4; break;
    case 2: record.type = at::kLong; itemsize = 8; break;
    case 3: record.type = at::kFloat; itemsize = 4; break;
    default: throw FramingError(name + " has unknown dtype code " + std::to_string(code) + " (known: 0-3)");
  }
  const auto ndim = in.pod<uint8_t>(("the dimension count of " + name).c_str());
  uint64_t count = 1;
  for (int i = 0; i < ndim; ++i) {
    const auto size = in.pod<int64_t>(("the sizes of " + name).c_str());
    if (size < 0)
      throw FramingError(name + " has negative size " + std::to_string(size) + " in dimension " + std::to_string(i));
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(size), &count))
      throw FramingError(name + " has more elements than fit in 64 bits");
    record.shape.push_back(size);
  }
  if (__builtin_mul_overflow(count, itemsize, &record.bytes))
    throw FramingError(name + " has " + std::to_string(count) + " elements, more bytes than fit in 64 bits");
  if (record.bytes > in.left())
    throw FramingError(name + " needs " + std::to_string(record.bytes) + " bytes of data but only " +
                       std::to_string(in.left()) + " are left in the file");
  record.present = true;
  record.data = in.take(record.bytes);
  return record;
}

// Why a located record cannot become a tensor of a request (empty: it can).
std::string refusal_of(const TensorRecord& record, const std::string& name, bool required) {
  if (!record.present)
    return required ? name + " is absent; every request needs values and lengths" : std::string();
  if (record.shape.size() > static_cast<size_t>(kMaxDims))
    return name + " has " + std::to_string(record.shape.size()) + " dimensions, over the limit of " +
           std::to_string(kMaxDims);
  return std::string();
}

// A located record that cannot become a tensor: the request is refused, the reader goes on after it.
class UnusableRecord : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// The record's tensor. Its data is inside the file, but a shape that holds no element may still have strides past
// int64 ([0, 2^62, 4]), which torch refuses: that is the request's refusal, not the run's end.
at::Tensor to_tensor(const TensorRecord& record, const std::string& name) {
  at::Tensor tensor;
  try {
    tensor = torch::empty(record.shape, torch::TensorOptions().dtype(record.type));
  } catch (const std::exception& err) {
    throw UnusableRecord(name + " has shape " + shape_text(record.shape) + ", which torch cannot hold (" +
                         one_line(err) + ")");
  }
  if (record.bytes > 0) std::memcpy(tensor.data_ptr(), record.data, static_cast<size_t>(record.bytes));
  return tensor;
}

std::optional<at::Tensor> to_optional_tensor(const TensorRecord& record, const std::string& name) {
  if (!record.present) return std::nullopt;
  return to_tensor(record, name);
}

// One request: its records located first (FramingError propagates), then refused or made into tensors.
ReadRequest read_request(Reader& in, bool has_dense) {
  const TensorRecord values = read_record(in, "values");
  const TensorRecord lengths = read_record(in, "lengths");
  const TensorRecord weights = read_record(in, "weights");
  const TensorRecord dense = has_dense ? read_record(in, "dense_features") : TensorRecord{};
  ReadRequest read;
  for (const auto& [record, name, required] : {std::tuple{&values, "values", true},
                                               std::tuple{&lengths, "lengths", true},
                                               std::tuple{&weights, "weights", false},
                                               std::tuple{&dense, "dense_features", false}}) {
    read.refusal = refusal_of(*record, name, required);
    if (!read.refusal.empty()) return read;
  }
  try {
    read.request = Request{to_tensor(values, "values"), to_tensor(lengths, "lengths"),
                           to_optional_tensor(weights, "weights"), to_optional_tensor(dense, "dense_features")};
  } catch (const UnusableRecord& err) {
    read.refusal = err.what();
  }
  return read;
}

std::vector<char> read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw FileError("cannot be opened");
  const std::streamoff size = in.tellg();
  if (size < 0) throw FileError("cannot be read");
  std::vector<char> data(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(data.data(), size)) throw FileError("cannot be read");
  return data;
}

// "requests 3-9 of 10 are not answered", "request 9 of 10 is not answered".
std::string are_not(uint64_t first, uint64_t count, const std::string& what) {
  const std::string of = " of " + std::to_string(count);
  if (first + 1 == count) return "request " + std::to_string(first) + of + " is not " + what;
  return "requests " + std::to_string(first) + "-" + std::to_string(count - 1) + of + " are not " + what;
}

// Every request that can be located; never throws for the file's contents (the problem is recorded instead).
RequestFile read_request_file(const std::string& path) {
  RequestFile file;
  std::optional<Reader> reader;
  try {
    reader.emplace(read_whole_file(path));
    if (reader->left() < 8) throw FileError("is not an embserve request file (magic EMBSRQ01 or EMBSRQ02)");
  } catch (const FileError& err) {
    file.problem = err.what();
    return file;
  } catch (const std::bad_alloc&) {
    file.problem = "is too large to be read into memory";
    return file;
  }
  const char* magic = reader->take(8);
  const bool has_dense = std::memcmp(magic, kRequestMagicV2, 8) == 0;
  if (!has_dense && std::memcmp(magic, kRequestMagicV1, 8) != 0) {
    file.problem = "is not an embserve request file (magic EMBSRQ01 or EMBSRQ02)";
    return file;
  }
  if (reader->left() < 4) {
    file.problem = "ends inside its header (the request count); the file is truncated";
    return file;
  }
  const auto declared = reader->pod<uint32_t>("the request count");
  if (declared > reader->left() / kMinRequestBytes) {
    file.problem = "says it holds " + std::to_string(declared) + " requests but " + std::to_string(reader->left()) +
                   " bytes hold at most " + std::to_string(reader->left() / kMinRequestBytes) +
                   "; the file is corrupted";
    return file;
  }
  file.header_ok = true;
  file.declared = declared;  // not reserved: the count passes at 5 bytes a request, a ReadRequest is far larger
  for (uint32_t i = 0; i < declared; ++i) {
    const uint64_t start = reader->offset();
    try {
      file.requests.push_back(read_request(*reader, has_dense));
    } catch (const FramingError& err) {
      file.problem = "request " + std::to_string(i) + " (from byte " + std::to_string(start) +
                     ") cannot be read: " + err.what() + "; nothing after it can be located, so " +
                     are_not(i, declared, "answered") +
                     " (the file is truncated or corrupted: write it again with infer.artifact.cpp_io.write_requests)";
      return file;
    }
  }
  if (reader->left() != 0)
    file.problem = "has " + std::to_string(reader->left()) + " bytes after its " + std::to_string(declared) +
                   " requests (all answered); the file is corrupted or its count is wrong";
  return file;
}

void write_tensor(std::ostream& out, const at::Tensor& input) {
  at::Tensor tensor = input.to(at::kCPU).contiguous();  // a CUDA model answers on its device
  uint8_t code = tensor.scalar_type() == at::kInt ? 1 : tensor.scalar_type() == at::kLong ? 2 : 3;
  write_pod<uint8_t>(out, code);
  write_pod<uint8_t>(out, static_cast<uint8_t>(tensor.dim()));
  for (auto size : tensor.sizes()) write_pod<int64_t>(out, size);
  out.write(static_cast<const char*>(tensor.data_ptr()), static_cast<std::streamsize>(tensor.nbytes()));
}

void write_string(std::ostream& out, const std::string& text) {
  write_pod<uint32_t>(out, static_cast<uint32_t>(text.size()));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

std::string error_kind(const std::exception& err) {
  if (dynamic_cast<const embserve::RequestError*>(&err)) return "RequestError";
  if (dynamic_cast<const embserve::ModelError*>(&err)) return "ModelError";
  if (dynamic_cast<const embserve::LibraryError*>(&err)) return "LibraryError";
  if (dynamic_cast<const embserve::ChecksumError*>(&err)) return "ChecksumError";
  if (dynamic_cast<const embserve::ManifestError*>(&err)) return "ManifestError";
  if (dynamic_cast<const embserve::Error*>(&err)) return "Error";
  if (dynamic_cast<const std::bad_alloc*>(&err)) return "OutOfMemory";
  if (dynamic_cast<const c10::Error*>(&err)) return "TorchError";
  return "Error";
}

constexpr const char* kUsage =
    "usage: embserve_run ARTIFACT [--requests FILE --out FILE]... [--fail-fast] [--library-dir DIR]... [--threads N]\n"
    "                    [--kernel-threads N] [--backend torchscript|pt2] [--verify full|none] [--unchecked]\n"
    "       embserve_run ARTIFACT --requests FILE [--out FILE] --bench N [--library-dir DIR]... [--threads N]\n"
    "                    [--kernel-threads N] [--backend torchscript|pt2] [--verify full|none] [--unchecked]\n"
    "       embserve_run --load-each ARTIFACT... [--requests FILE] [--library-dir DIR]... [--threads N]\n"
    "                    [--kernel-threads N] [--backend torchscript|pt2] [--verify full|none]\n";

constexpr const char* kHelp =
    "Every request of a file is answered in --out: a result, or a typed error record for a bad one (the run goes\n"
    "on; --fail-fast stops at the first failure). Where a file's framing breaks, the requests before it are\n"
    "answered and the file's closing record says where (infer.artifact.cpp_io.read_response_file).\n"
    "exit status: 0 every request succeeded\n"
    "             1 some request failed, a request file is broken after its header, or the artifact cannot be loaded\n"
    "             2 usage error, a request file that cannot be read at all, or an --out that cannot be written\n"
    "--load-each loads each ARTIFACT in turn (a fresh model each; with --requests it answers every request of FILE)\n"
    "and prints \"ARTIFACT: ok\", \"ARTIFACT: KIND: MESSAGE\" or \"ARTIFACT: request I: KIND: MESSAGE\" per folder on\n"
    "stdout; status 1 when any folder failed.\n";

// The load's rate: the bytes of the files the manifest lists over Model::load's seconds, in GB/s.
double load_rate(const embserve::Model& model) {
  return model.load_seconds() > 0 ? static_cast<double>(model.load_bytes()) / model.load_seconds() / 1e9 : 0.0;
}

int usage() {
  std::cerr << kUsage;
  return kCannotRun;
}

// The response file's writer (version 2): the request count, one record per request read, a closing record.
class ResponseWriter {
 public:
  ResponseWriter(const std::string& path, uint32_t declared) : out_(path, std::ios::binary) {
    out_.write(kResponseMagic, 8);
    write_pod<uint32_t>(out_, declared);
  }
  bool good() const { return static_cast<bool>(out_); }
  void result(const at::Tensor& output) {
    write_pod<uint8_t>(out_, kResult);
    write_tensor(out_, output);
  }
  void error(const std::string& kind, const std::string& message) {
    write_pod<uint8_t>(out_, kError);
    write_string(out_, kind);
    write_string(out_, message);
  }
  // Every request was read and run (none left out), whatever their records say.
  void end() { write_pod<uint8_t>(out_, kEndWhole); }
  // The file's own problem, or why the records stop before the request count.
  void end_with_error(const std::string& kind, const std::string& message) {
    write_pod<uint8_t>(out_, kEndWithError);
    write_string(out_, kind);
    write_string(out_, message);
  }
  bool close() {
    out_.close();
    return !out_.fail();
  }

 private:
  std::ofstream out_;
};

// Runs one request file, writing its responses to out_path; stops at the first failure under --fail-fast.
Status run_file(const embserve::Model& model, const std::string& requests_path, const std::string& out_path,
                bool fail_fast) {
  const RequestFile file = read_request_file(requests_path);
  ResponseWriter out(out_path, file.declared);
  if (!out.good()) {
    std::cerr << "embserve_run: " << out_path << ": cannot be written\n";
    return kCannotRun;
  }
  Status status = file.header_ok ? kAllOk : kCannotRun;
  std::string closing_kind = kFileFormatError, closing = file.problem;
  for (size_t i = 0; i < file.requests.size(); ++i) {
    const ReadRequest& read = file.requests[i];
    std::string kind = kFileFormatError, message = read.refusal;
    if (message.empty()) {
      try {
        out.result(answer(model, read.request));
        continue;
      } catch (const std::exception& err) {
        kind = error_kind(err);
        message = one_line(err);
      }
    }
    message = bounded(message);
    std::cerr << "embserve_run: " << requests_path << ": request " << i << ": " << kind << ": " << message << "\n";
    out.error(kind, message);
    status = std::max(status, kSomeFailed);
    if (fail_fast) {
      if (i + 1 < file.declared) {
        closing_kind = kNotRun;
        closing = "stopped after request " + std::to_string(i) + " failed (--fail-fast): " +
                  are_not(i + 1, file.declared, "run");
      }
      break;
    }
  }
  if (closing.empty()) {
    out.end();
  } else {
    closing = bounded(closing);
    std::cerr << "embserve_run: " << requests_path << ": " << closing_kind << ": " << closing << "\n";
    out.end_with_error(closing_kind, closing);
    status = std::max(status, kSomeFailed);
  }
  if (!out.close()) {
    std::cerr << "embserve_run: " << out_path << ": writing failed\n";
    return kCannotRun;
  }
  return status;
}

// --bench: times `calls` answers cycling through the requests of one file whose every request can be read.
Status bench(const embserve::Model& model, const std::string& requests_path, long calls, const std::string& verify) {
  const RequestFile file = read_request_file(requests_path);
  std::string problem = file.problem;
  for (size_t i = 0; problem.empty() && i < file.requests.size(); ++i)
    if (!file.requests[i].refusal.empty()) problem = "request " + std::to_string(i) + ": " + file.requests[i].refusal;
  if (!problem.empty()) {
    std::cerr << "embserve_run: " << requests_path << ": --bench needs a file whose every request can be read: "
              << bounded(problem) << "\n";
    return kCannotRun;
  }
  if (file.requests.empty()) return static_cast<Status>(usage());
  const auto& requests = file.requests;
  try {
    long warmup = std::min<long>(calls, 100);
    for (long i = 0; i < warmup; ++i) answer(model, requests[static_cast<size_t>(i) % requests.size()].request);
    std::vector<double> latencies;
    latencies.reserve(static_cast<size_t>(calls));
    int64_t ids = 0, bags = 0;
    auto started = std::chrono::steady_clock::now();
    for (long i = 0; i < calls; ++i) {
      const auto& r = requests[static_cast<size_t>(i) % requests.size()].request;
      auto t0 = std::chrono::steady_clock::now();
      answer(model, r);
      auto t1 = std::chrono::steady_clock::now();
      latencies.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      ids += r.values.numel();
      bags += r.lengths.numel();
    }
    double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::vector<double> sorted = latencies;
    std::sort(sorted.begin(), sorted.end());
    double mean = 0;
    for (double v : latencies) mean += v;
    mean /= static_cast<double>(latencies.size());
    auto pct = [&](double q) { return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * sorted.size()))]; };
    std::cout << "{\"bench\": \"embserve_run\", \"backend\": \""
              << (model.backend() == embserve::Backend::Pt2 ? "pt2" : "torchscript") << "\", \"calls\": " << calls
              << ", \"mean_us\": " << mean << ", \"p50_us\": " << pct(0.5) << ", \"p99_us\": " << pct(0.99)
              << ", \"calls_per_s\": " << calls / total_s << ", \"lookups_per_s\": " << ids / total_s
              << ", \"bags_per_s\": " << bags / total_s << ", \"verify\": \"" << verify
              << "\", \"load_s\": " << model.load_seconds() << ", \"library_s\": " << model.library_seconds()
              << ", \"load_bytes\": " << model.load_bytes()
              << ", \"load_gb_per_s\": " << load_rate(model) << "}" << std::endl;
  } catch (const std::exception& err) {
    std::cerr << "embserve_run: bench failed: " << error_kind(err) << ": " << one_line(err) << "\n";
    return kSomeFailed;
  }
  return kAllOk;
}

// --load-each: every folder loaded in turn, each into a fresh Model released before the next; one stdout line each.
// With requests (read from one --requests file) each loaded model answers them all; the first that fails is the
// folder's outcome ("request I: KIND: MESSAGE").
Status load_each(const std::vector<std::string>& artifacts, const embserve::LoadOptions& options,
                 const std::vector<ReadRequest>& requests) {
  Status status = kAllOk;
  for (const auto& artifact : artifacts) {
    std::string outcome = "ok";
    try {
      const embserve::Model loaded = embserve::Model::load(artifact, options);  // released before the next folder
      for (size_t i = 0; i < requests.size() && outcome == "ok"; ++i) {
        try {
          answer(loaded, requests[i].request);
        } catch (const std::exception& err) {
          outcome = "request " + std::to_string(i) + ": " + error_kind(err) + ": " + one_line(err);
        }
      }
    } catch (const std::exception& err) {
      outcome = error_kind(err) + ": " + one_line(err);
    }
    if (outcome != "ok") status = kSomeFailed;
    std::cout << artifact << ": " << outcome << std::endl;  // flushed: a crash still shows the folders before it
  }
  return status;
}

int run(int argc, char** argv) {
  std::string artifact;
  std::vector<std::string> load_each_paths;
  bool load_each_mode = false;
  std::vector<std::string> requests_paths, out_paths;
  long bench_calls = 0;
  bool fail_fast = false;
  embserve::LoadOptions options;
  std::string verify = "full";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    try {
      if (arg == "--requests") requests_paths.push_back(next());
      else if (arg == "--out") out_paths.push_back(next());
      else if (arg == "--fail-fast") fail_fast = true;
      else if (arg == "--unchecked") unchecked_entries = true;
      else if (arg == "--load-each") load_each_mode = true;
      else if (arg == "--bench") bench_calls = std::stol(next());
      else if (arg == "--library-dir") options.library_dirs.push_back(next());
      else if (arg == "--threads") options.intra_op_threads = std::stoi(next());
      else if (arg == "--kernel-threads") options.kernel_threads = std::stoi(next());
      else if (arg == "--verify") {
        verify = next();
        if (verify == "full") options.verify = embserve::Verify::Full;
        else if (verify == "none") options.verify = embserve::Verify::None;
        else throw std::invalid_argument("unknown verify mode '" + verify + "' (full or none)");
      }
      else if (arg == "--backend") {
        const std::string backend = next();
        if (backend == "torchscript") options.backend = embserve::Backend::TorchScript;
        else if (backend == "pt2") options.backend = embserve::Backend::Pt2;
        else throw std::invalid_argument("unknown backend '" + backend + "' (torchscript or pt2)");
      }
      else if (arg == "-h" || arg == "--help") {
        std::cout << kUsage << kHelp;
        return kAllOk;
      }
      else if (!arg.empty() && arg[0] == '-') return usage();
      else if (load_each_mode) load_each_paths.push_back(arg);
      else if (artifact.empty()) artifact = arg;
      else return usage();
    } catch (const std::exception& err) {
      std::cerr << "embserve_run: " << arg << ": " << one_line(err) << "\n";
      return usage();
    }
  }
  if (load_each_mode) {
    if (!artifact.empty()) load_each_paths.insert(load_each_paths.begin(), artifact);  // a folder before the flag
    if (load_each_paths.empty() || requests_paths.size() > 1 || !out_paths.empty() || bench_calls > 0 || fail_fast ||
        unchecked_entries)
      return usage();
    RequestFile file;
    if (!requests_paths.empty()) {
      file = read_request_file(requests_paths[0]);
      std::string problem = file.problem;
      for (size_t i = 0; problem.empty() && i < file.requests.size(); ++i)
        if (!file.requests[i].refusal.empty())
          problem = "request " + std::to_string(i) + ": " + file.requests[i].refusal;
      if (!problem.empty()) {
        std::cerr << "embserve_run: " << requests_paths[0]
                  << ": --load-each needs a file whose every request can be read: " << bounded(problem) << "\n";
        return kCannotRun;
      }
    }
    return load_each(load_each_paths, options, file.requests);
  }
  // --requests/--out pairs run in order (one process, one load); --bench times the one --requests file.
  if (artifact.empty() || (bench_calls > 0 ? requests_paths.size() != 1 || out_paths.size() > 1
                                           : requests_paths.size() != out_paths.size()))
    return usage();

  std::optional<embserve::Model> loaded;
  try {
    loaded.emplace(embserve::Model::load(artifact, options));
  } catch (const std::exception& err) {
    // Status 1, as before status 2 existed: callers and tests of the loader's refusals rely on it.
    std::cerr << "embserve_run: " << error_kind(err) << ": " << one_line(err) << "\n";
    return kSomeFailed;
  }
  const embserve::Model& model = *loaded;
  if (unchecked_entries && !requests_paths.empty())  // which path Model::lookup_unchecked takes (the tests read it)
    std::cout << "lookup_unchecked: " << (model.direct_lookup() ? "direct" : "torchscript") << "\n";
  if (requests_paths.empty()) {
    std::cout << "loaded " << artifact << " (" << (model.backend() == embserve::Backend::Pt2 ? "pt2" : "torchscript")
              << "): " << model.features().size() << " features, output_dim "
              << model.output_dim()
              << (model.has_dense() ? ", dense part of " + std::to_string(model.num_dense_features()) + " inputs"
                                    : std::string(", no dense part"))
              << "; fbgemm libraries:";
    for (const auto& library : model.libraries()) std::cout << " " << library;
    std::cout << "\nload: " << model.load_seconds() << " s (" << model.library_seconds() << " s of it loading "
              << "libraries), " << model.load_bytes() << " bytes listed, "
              << load_rate(model) << " GB/s ("
              << (verify == "full" ? "checksums verified" : "sizes checked, checksums not verified") << ")\n";
    return kAllOk;
  }
  Status status = kAllOk;
  for (size_t i = 0; i < out_paths.size(); ++i) {
    status = std::max(status, run_file(model, requests_paths[i], out_paths[i], fail_fast));
    if (fail_fast && status != kAllOk) return status;
  }
  if (bench_calls > 0) status = std::max(status, bench(model, requests_paths[0], bench_calls, verify));
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  // Nothing escapes as a signal or a backtrace: every error ends as one line on stderr and status 1.
  try {
    return run(argc, argv);
  } catch (const std::exception& err) {
    std::cerr << "embserve_run: " << error_kind(err) << ": " << one_line(err) << "\n";
  } catch (...) {
    std::cerr << "embserve_run: unknown error\n";
  }
  return kSomeFailed;
}
