// embserve_run ARTIFACT [--requests FILE --out FILE]... [--bench N] [--library-dir DIR]... [--threads N]
//              [--kernel-threads N] [--backend torchscript|pt2]
//
// Runs the requests in FILE (written by infer.cpp_io.write_requests) and writes one result per request
// to --out (read by infer.cpp_io.read_responses). The method follows from each request: one that carries
// dense_features (request file version 2) is a predict, answered with the scores [batch] float32; one without
// is a lookup, answered with the pooled embeddings [batch, output_dim] float32. A request that fails validation is reported on
// stderr and as an error record, and the run goes on. --bench N times N lookups (cycling through the
// requests) after a warm-up and prints one JSON line with per-call latency and lookups (ids) per second
// (predict requests are timed as predicts).
// Exit status: 0 when every request succeeded, 1 when any failed (or the artifact or request file is bad),
// 2 on a usage error. Every error is one line on stderr ("embserve_run: ..."), never a backtrace.
// --threads sets torch's intra-op threads; --kernel-threads how many example ranges each CPU kernel may split
// a batch into (LoadOptions::kernel_threads; default cores / CPU kernels, as Python's load).
// --backend picks the model file that runs: model.pt (torchscript, the default) or model.pt2 (pt2, an AOTInductor
// package; the artifact must be exported with `embserve export --pt2`).
// File format: see infer/artifact/cpp_io.py (request files EMBSRQ01 and EMBSRQ02, response files EMBSRS01).
#include <embserve/loader.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// Version 1: values, lengths, weights per request; version 2 adds dense_features (absent: a lookup).
constexpr char kRequestMagicV1[8] = {'E', 'M', 'B', 'S', 'R', 'Q', '0', '1'};
constexpr char kRequestMagicV2[8] = {'E', 'M', 'B', 'S', 'R', 'Q', '0', '2'};
constexpr char kResponseMagic[8] = {'E', 'M', 'B', 'S', 'R', 'S', '0', '1'};
constexpr int kMaxDims = 8;
// The smallest request record: values and lengths each a dtype code and ndim 0, weights absent (version 2:
// dense_features absent too).
constexpr uint64_t kMinRequestBytes = 5;
// Messages echoed on stderr and into the response file are cut to this many bytes.
constexpr size_t kMaxMessageBytes = 1024;

struct Request {
  at::Tensor values, lengths;
  std::optional<at::Tensor> weights;
  std::optional<at::Tensor> dense_features;  // present: a predict request
};

// A request's answer: the scores of a predict request, else the pooled lookups.
at::Tensor answer(const embserve::Model& model, const Request& r) {
  if (r.dense_features) return model.predict(*r.dense_features, r.values, r.lengths, r.weights);
  return model.lookup(r.values, r.lengths, r.weights);
}

// A malformed request file: the message names the problem, main prefixes the file's path.
class FileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The whole request file in memory, read with every size checked against the bytes left.
class Reader {
 public:
  explicit Reader(std::vector<char> data) : data_(std::move(data)) {}
  uint64_t left() const { return data_.size() - at_; }
  uint64_t offset() const { return at_; }

  template <typename T>
  T pod(const char* what) {
    if (left() < sizeof(T))
      throw FileError("truncated at byte " + std::to_string(at_) + " (reading " + what + ")");
    T value{};
    std::memcpy(&value, data_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }

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

std::optional<at::Tensor> read_tensor(Reader& in, const std::string& where) {
  auto code = in.pod<uint8_t>("a dtype code");
  if (code == 0) return std::nullopt;
  at::ScalarType type;
  uint64_t itemsize = 0;
  switch (code) {
    case 1: type = at::kInt; itemsize = 4; break;
    case 2: type = at::kLong; itemsize = 8; break;
    case 3: type = at::kFloat; itemsize = 4; break;
    default: throw FileError(where + " has unknown dtype code " + std::to_string(code) + " (known: 0-3)");
  }
  auto ndim = in.pod<uint8_t>("a dimension count");
  if (ndim > kMaxDims)
    throw FileError(where + " has " + std::to_string(ndim) + " dimensions, over the limit of " +
                    std::to_string(kMaxDims));
  std::vector<int64_t> shape;
  uint64_t count = 1;
  for (int i = 0; i < ndim; ++i) {
    auto size = in.pod<int64_t>("a dimension size");
    if (size < 0) throw FileError(where + " has negative size " + std::to_string(size) + " in dimension " + std::to_string(i));
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(size), &count))
      throw FileError(where + " has more elements than fit in 64 bits");
    shape.push_back(size);
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, itemsize, &bytes))
    throw FileError(where + " has " + std::to_string(count) + " elements, more bytes than fit in 64 bits");
  if (bytes > in.left())
    throw FileError(where + " needs " + std::to_string(bytes) + " bytes of data but only " +
                    std::to_string(in.left()) + " are left in the file; the file is truncated or corrupted");
  at::Tensor tensor = torch::empty(shape, torch::TensorOptions().dtype(type));
  if (bytes > 0) std::memcpy(tensor.data_ptr(), in.take(bytes), static_cast<size_t>(bytes));
  return tensor;
}

void write_tensor(std::ostream& out, const at::Tensor& input) {
  at::Tensor tensor = input.contiguous();
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

std::vector<Request> read_requests(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw FileError("cannot be opened");
  const std::streamoff size = in.tellg();
  if (size < 0) throw FileError("cannot be read");
  std::vector<char> data(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(data.data(), size)) throw FileError("cannot be read");
  Reader reader(std::move(data));
  if (reader.left() < 8) throw FileError("is not an embserve request file (magic EMBSRQ01 or EMBSRQ02)");
  const char* magic = reader.take(8);
  const bool has_dense = std::memcmp(magic, kRequestMagicV2, 8) == 0;
  if (!has_dense && std::memcmp(magic, kRequestMagicV1, 8) != 0)
    throw FileError("is not an embserve request file (magic EMBSRQ01 or EMBSRQ02)");
  auto count = reader.pod<uint32_t>("the request count");
  if (count > reader.left() / kMinRequestBytes)
    throw FileError("says it holds " + std::to_string(count) + " requests but " + std::to_string(reader.left()) +
                    " bytes hold at most " + std::to_string(reader.left() / kMinRequestBytes));
  std::vector<Request> requests;
  requests.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    const std::string where = "request " + std::to_string(i);
    Request request;
    auto values = read_tensor(reader, where + " values");
    auto lengths = read_tensor(reader, where + " lengths");
    if (!values || !lengths) throw FileError(where + " lacks values or lengths");
    request.values = *values;
    request.lengths = *lengths;
    request.weights = read_tensor(reader, where + " weights");
    if (has_dense) request.dense_features = read_tensor(reader, where + " dense_features");
    requests.push_back(std::move(request));
  }
  if (reader.left() != 0)
    throw FileError("has " + std::to_string(reader.left()) + " bytes after its " + std::to_string(count) +
                    " requests; the file is corrupted");
  return requests;
}

// One line, bounded: an exception's message without c10's backtrace, newlines and control bytes blanked.
std::string one_line(const std::exception& err) {
  std::string text;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&err))
    text = c10_error->what_without_backtrace();
  else
    text = err.what();
  for (char& c : text)
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  if (text.size() > kMaxMessageBytes) {
    size_t cut = kMaxMessageBytes;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 char
    text = text.substr(0, cut) + "...(" + std::to_string(text.size()) + " bytes)";
  }
  return text;
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

int usage() {
  std::cerr << "usage: embserve_run ARTIFACT [--requests FILE --out FILE]... [--library-dir DIR]... [--threads N]\n"
               "                    [--kernel-threads N] [--backend torchscript|pt2]\n"
               "       embserve_run ARTIFACT --requests FILE [--out FILE] --bench N [--library-dir DIR]... [--threads N]\n"
               "                    [--kernel-threads N] [--backend torchscript|pt2]\n";
  return 2;
}

// Run one request file, writing its responses to out_path; false when the file or any request failed.
bool run_file(const embserve::Model& model, const std::string& requests_path, const std::string& out_path) {
  std::vector<Request> requests;
  try {
    requests = read_requests(requests_path);
  } catch (const std::exception& err) {
    std::cerr << "embserve_run: " << requests_path << ": " << one_line(err) << "\n";
    return false;
  }
  std::ofstream out(out_path, std::ios::binary);
  if (!out) {
    std::cerr << "embserve_run: " << out_path << ": cannot be written\n";
    return false;
  }
  out.write(kResponseMagic, 8);
  write_pod<uint32_t>(out, static_cast<uint32_t>(requests.size()));
  bool ok = true;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    at::Tensor result;
    try {
      result = answer(model, r);
    } catch (const std::exception& err) {
      ok = false;
      const std::string message = one_line(err);
      std::cerr << "embserve_run: " << requests_path << ": request " << i << ": " << error_kind(err) << ": " << message
                << "\n";
      write_pod<uint8_t>(out, 1);
      write_string(out, error_kind(err));
      write_string(out, message);
      continue;
    }
    write_pod<uint8_t>(out, 0);
    write_tensor(out, result);
  }
  if (!out) {
    std::cerr << "embserve_run: " << out_path << ": writing failed\n";
    return false;
  }
  return ok;
}

int run(int argc, char** argv) {
  std::string artifact;
  std::vector<std::string> requests_paths, out_paths;
  long bench = 0;
  embserve::LoadOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    try {
      if (arg == "--requests") requests_paths.push_back(next());
      else if (arg == "--out") out_paths.push_back(next());
      else if (arg == "--bench") bench = std::stol(next());
      else if (arg == "--library-dir") options.library_dirs.push_back(next());
      else if (arg == "--threads") options.intra_op_threads = std::stoi(next());
      else if (arg == "--kernel-threads") options.kernel_threads = std::stoi(next());
      else if (arg == "--backend") {
        const std::string backend = next();
        if (backend == "torchscript") options.backend = embserve::Backend::TorchScript;
        else if (backend == "pt2") options.backend = embserve::Backend::Pt2;
        else throw std::invalid_argument("unknown backend '" + backend + "' (torchscript or pt2)");
      }
      else if (arg == "-h" || arg == "--help") return usage(), 0;
      else if (!arg.empty() && arg[0] == '-') return usage();
      else if (artifact.empty()) artifact = arg;
      else return usage();
    } catch (const std::exception& err) {
      std::cerr << "embserve_run: " << arg << ": " << one_line(err) << "\n";
      return usage();
    }
  }
  // --requests/--out pairs run in order (one process, one load); --bench times the one --requests file.
  if (artifact.empty() || (bench > 0 ? requests_paths.size() != 1 || out_paths.size() > 1
                                     : requests_paths.size() != out_paths.size()))
    return usage();

  std::optional<embserve::Model> loaded;
  try {
    loaded.emplace(embserve::Model::load(artifact, options));
  } catch (const std::exception& err) {
    std::cerr << "embserve_run: " << error_kind(err) << ": " << one_line(err) << "\n";
    return 1;
  }
  const embserve::Model& model = *loaded;
  if (requests_paths.empty()) {
    std::cout << "loaded " << artifact << " (" << (model.backend() == embserve::Backend::Pt2 ? "pt2" : "torchscript")
              << "): " << model.features().size() << " features, output_dim "
              << model.output_dim()
              << (model.has_dense() ? ", dense part of " + std::to_string(model.num_dense_features()) + " inputs"
                                    : std::string(", no dense part"))
              << "; fbgemm libraries:";
    for (const auto& library : model.libraries()) std::cout << " " << library;
    std::cout << "\n";
    return 0;
  }
  bool all_ok = true;
  for (size_t i = 0; i < out_paths.size(); ++i) all_ok = run_file(model, requests_paths[i], out_paths[i]) && all_ok;

  if (bench > 0) {
    std::vector<Request> requests;
    try {
      requests = read_requests(requests_paths[0]);
    } catch (const std::exception& err) {
      std::cerr << "embserve_run: " << requests_paths[0] << ": " << one_line(err) << "\n";
      return 1;
    }
    if (requests.empty()) return usage();
    try {
      long warmup = std::min<long>(bench, 100);
      for (long i = 0; i < warmup; ++i) {
        const auto& r = requests[static_cast<size_t>(i) % requests.size()];
        answer(model, r);
      }
      std::vector<double> latencies;
      latencies.reserve(static_cast<size_t>(bench));
      int64_t ids = 0, bags = 0;
      auto started = std::chrono::steady_clock::now();
      for (long i = 0; i < bench; ++i) {
        const auto& r = requests[static_cast<size_t>(i) % requests.size()];
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
                << (model.backend() == embserve::Backend::Pt2 ? "pt2" : "torchscript") << "\", \"calls\": " << bench
                << ", \"mean_us\": " << mean
                << ", \"p50_us\": " << pct(0.5) << ", \"p99_us\": " << pct(0.99)
                << ", \"calls_per_s\": " << bench / total_s << ", \"lookups_per_s\": " << ids / total_s
                << ", \"bags_per_s\": " << bags / total_s << "}" << std::endl;
    } catch (const std::exception& err) {
      std::cerr << "embserve_run: bench failed: " << error_kind(err) << ": " << one_line(err) << "\n";
      return 1;
    }
  }
  // A failed request is answered with its error record, and the run says so in its status.
  return all_ok ? 0 : 1;
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
  return 1;
}
