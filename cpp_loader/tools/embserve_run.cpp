// embserve_run ARTIFACT [--requests FILE --out FILE] [--bench N] [--library-dir DIR]... [--threads N]
//
// Runs the lookups in FILE (written by infer.cpp_io.write_requests) and writes one result per request
// to --out (read by infer.cpp_io.read_responses). A request that fails validation is reported on
// stderr and as an error record, and the run goes on. --bench N times N lookups (cycling through the
// requests) after a warm-up and prints one JSON line with per-call latency and lookups (ids) per second.
// File format: see infer/cpp_io.py.
#include <embserve/loader.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr char kRequestMagic[8] = {'E', 'M', 'B', 'S', 'R', 'Q', '0', '1'};
constexpr char kResponseMagic[8] = {'E', 'M', 'B', 'S', 'R', 'S', '0', '1'};

struct Request {
  at::Tensor values, lengths;
  std::optional<at::Tensor> weights;
};

template <typename T>
T read_pod(std::istream& in) {
  T value{};
  in.read(reinterpret_cast<char*>(&value), sizeof(T));
  if (!in) throw std::runtime_error("request file is truncated");
  return value;
}

template <typename T>
void write_pod(std::ostream& out, T value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(T));
}

std::optional<at::Tensor> read_tensor(std::istream& in) {
  auto code = read_pod<uint8_t>(in);
  if (code == 0) return std::nullopt;
  at::ScalarType type;
  switch (code) {
    case 1: type = at::kInt; break;
    case 2: type = at::kLong; break;
    case 3: type = at::kFloat; break;
    default: throw std::runtime_error("request file has unknown dtype code " + std::to_string(code));
  }
  auto ndim = read_pod<uint8_t>(in);
  std::vector<int64_t> shape;
  for (int i = 0; i < ndim; ++i) shape.push_back(read_pod<int64_t>(in));
  at::Tensor tensor = torch::empty(shape, torch::TensorOptions().dtype(type));
  in.read(static_cast<char*>(tensor.data_ptr()), static_cast<std::streamsize>(tensor.nbytes()));
  if (!in && tensor.nbytes() > 0) throw std::runtime_error("request file is truncated");
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
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open request file " + path);
  char magic[8];
  in.read(magic, 8);
  if (!in || std::memcmp(magic, kRequestMagic, 8) != 0)
    throw std::runtime_error(path + " is not an embserve request file (magic EMBSRQ01)");
  auto count = read_pod<uint32_t>(in);
  std::vector<Request> requests;
  for (uint32_t i = 0; i < count; ++i) {
    Request request;
    auto values = read_tensor(in);
    auto lengths = read_tensor(in);
    if (!values || !lengths) throw std::runtime_error("request " + std::to_string(i) + " lacks values or lengths");
    request.values = *values;
    request.lengths = *lengths;
    request.weights = read_tensor(in);
    requests.push_back(std::move(request));
  }
  return requests;
}

std::string error_kind(const std::exception& err) {
  if (dynamic_cast<const embserve::RequestError*>(&err)) return "RequestError";
  if (dynamic_cast<const embserve::ModelError*>(&err)) return "ModelError";
  if (dynamic_cast<const embserve::LibraryError*>(&err)) return "LibraryError";
  if (dynamic_cast<const embserve::ChecksumError*>(&err)) return "ChecksumError";
  if (dynamic_cast<const embserve::ManifestError*>(&err)) return "ManifestError";
  if (dynamic_cast<const embserve::Error*>(&err)) return "Error";
  return "std::exception";
}

int usage() {
  std::cerr << "usage: embserve_run ARTIFACT [--requests FILE --out FILE] [--bench N] [--library-dir DIR]... "
               "[--threads N]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string artifact, requests_path, out_path;
  long bench = 0;
  embserve::LoadOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    try {
      if (arg == "--requests") requests_path = next();
      else if (arg == "--out") out_path = next();
      else if (arg == "--bench") bench = std::stol(next());
      else if (arg == "--library-dir") options.library_dirs.push_back(next());
      else if (arg == "--threads") options.intra_op_threads = std::stoi(next());
      else if (arg == "-h" || arg == "--help") return usage(), 0;
      else if (!arg.empty() && arg[0] == '-') return usage();
      else if (artifact.empty()) artifact = arg;
      else return usage();
    } catch (const std::exception& err) {
      std::cerr << "embserve_run: " << err.what() << "\n";
      return usage();
    }
  }
  if (artifact.empty() || (requests_path.empty() && (bench > 0 || !out_path.empty()))) return usage();

  embserve::Model model = [&] {
    try {
      return embserve::Model::load(artifact, options);
    } catch (const std::exception& err) {
      std::cerr << "embserve_run: " << error_kind(err) << ": " << err.what() << "\n";
      std::exit(1);
    }
  }();
  if (requests_path.empty()) {
    std::cout << "loaded " << artifact << ": " << model.features().size() << " features, output_dim "
              << model.output_dim() << "; fbgemm libraries:";
    for (const auto& library : model.libraries()) std::cout << " " << library;
    std::cout << "\n";
    return 0;
  }
  std::vector<Request> requests;
  try {
    requests = read_requests(requests_path);
  } catch (const std::exception& err) {
    std::cerr << "embserve_run: " << err.what() << "\n";
    return 1;
  }

  int failed = 0;
  if (!out_path.empty()) {
    std::ofstream out(out_path, std::ios::binary);
    if (!out) {
      std::cerr << "embserve_run: cannot write " << out_path << "\n";
      return 1;
    }
    out.write(kResponseMagic, 8);
    write_pod<uint32_t>(out, static_cast<uint32_t>(requests.size()));
    for (size_t i = 0; i < requests.size(); ++i) {
      const auto& r = requests[i];
      try {
        at::Tensor result = model.lookup(r.values, r.lengths, r.weights);
        write_pod<uint8_t>(out, 0);
        write_tensor(out, result);
      } catch (const std::exception& err) {
        ++failed;
        std::cerr << "request " << i << ": " << error_kind(err) << ": " << err.what() << "\n";
        write_pod<uint8_t>(out, 1);
        write_string(out, error_kind(err));
        write_string(out, err.what());
      }
    }
    if (!out) {
      std::cerr << "embserve_run: writing " << out_path << " failed\n";
      return 1;
    }
  }

  if (bench > 0) {
    if (requests.empty()) return usage();
    try {
      long warmup = std::min<long>(bench, 100);
      for (long i = 0; i < warmup; ++i) {
        const auto& r = requests[static_cast<size_t>(i) % requests.size()];
        model.lookup(r.values, r.lengths, r.weights);
      }
      std::vector<double> latencies;
      latencies.reserve(static_cast<size_t>(bench));
      int64_t ids = 0, bags = 0;
      auto started = std::chrono::steady_clock::now();
      for (long i = 0; i < bench; ++i) {
        const auto& r = requests[static_cast<size_t>(i) % requests.size()];
        auto t0 = std::chrono::steady_clock::now();
        model.lookup(r.values, r.lengths, r.weights);
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
      std::cout << "{\"bench\": \"embserve_run\", \"calls\": " << bench << ", \"mean_us\": " << mean
                << ", \"p50_us\": " << pct(0.5) << ", \"p99_us\": " << pct(0.99)
                << ", \"calls_per_s\": " << bench / total_s << ", \"lookups_per_s\": " << ids / total_s
                << ", \"bags_per_s\": " << bags / total_s << "}" << std::endl;
    } catch (const std::exception& err) {
      std::cerr << "embserve_run: bench failed: " << error_kind(err) << ": " << err.what() << "\n";
      return 1;
    }
  }
  return 0;
}
