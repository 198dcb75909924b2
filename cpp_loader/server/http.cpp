// OIP REST on cpp-httplib: server/adapters/oip/rest_server.py in C++ (routes, JSON and binary tensors, words).
#include "http.h"

#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>

#include "batcher.h"
#include "internal_error.h"
#include "metrics.h"
#include "oip_codec.h"
#include "request.h"
#include "service.h"
#include "statistics.h"

namespace embserve::server {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

constexpr const char* kHeaderLength = "Inference-Header-Content-Length";
constexpr size_t kMaxHeaderLines = 100;
constexpr const char* kDraining = "the server is shutting down; retry on another replica";

// A refusal with the gRPC code it stands for (the metrics' label), its HTTP status and rejected-total reason
// (server.pipeline.Failure answered by rest_server._respond).
struct Refusal {
  const char* code;
  int status;
  std::string message;
  const char* reason;
};

// A JSON text, ASCII only as Python's json.dumps writes it. Bytes that are no UTF-8 (a client's path or body
// quoted in a message, a message cut inside a character) become U+FFFD, as urllib's unquote makes them: dump's
// default would throw and turn a refusal into a 500.
std::string dumped(const Json& value) { return value.dump(-1, ' ', true, Json::error_handler_t::replace); }

// the JSON body of every error: {"error": "..."}
void put_error(httplib::Response& response, int status, const std::string& message) {
  response.status = status;
  response.set_content(dumped(Json{{"error", bounded(message)}}), "application/json");
}

void put_json(httplib::Response& response, const Json& payload) {
  response.status = 200;
  response.set_content(dumped(payload), "application/json");
}

// The value of a header given more than once is its last one, as the Python server's header dict keeps it
// (httplib's get_header_value answers the first).
std::string last_header(const httplib::Request& request, const char* name) {
  const size_t count = request.get_header_value_count(name);
  return count == 0 ? std::string() : request.get_header_value(name, count - 1);
}

// rest_server.check_json_depth: a JSON text nested deeper than kMaxJsonDepth is refused before it is parsed, so no
// recursive walk over it (the tensor's nest, a message quoting a value, the echoed id) can run out of stack.
constexpr int kMaxJsonDepth = 100;
void check_json_depth(const char* begin, const char* end) {
  int depth = 0;
  bool in_string = false;
  for (const char* p = begin; p < end; ++p) {
    const char c = *p;
    if (in_string) {
      if (c == '\\') {
        ++p;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth)
        throw BadRequest("the request nests JSON deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() != b.size();
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(1, b.size())]);
  return diff == 0;
}

// urllib.parse.unquote: %XX escapes decoded (a malformed one stays as it is)
std::string unquote(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size() && hex(text[i + 1]) >= 0 && hex(text[i + 2]) >= 0) {
      out += static_cast<char>(hex(text[i + 1]) * 16 + hex(text[i + 2]));
      i += 2;
    } else {
      out += text[i];
    }
  }
  return out;
}

// Python's truth of a JSON value (`x or {}`, bool(x))
bool truthy(const Json& value) {
  if (value.is_null()) return false;
  if (value.is_boolean()) return value.get<bool>();
  if (value.is_number_unsigned()) return value.get<uint64_t>() != 0;
  if (value.is_number_integer()) return value.get<int64_t>() != 0;
  if (value.is_number_float()) return value.get<double>() != 0.0;
  if (value.is_string()) return !value.get_ref<const std::string&>().empty();  // json's empty() holds for no scalar
  return !value.empty();  // array, object
}

// codec.parameter_flag of a JSON parameters object
bool flag(const Json& parameters, const char* name) {
  if (!parameters.is_object()) return false;
  auto it = parameters.find(name);
  if (it == parameters.end()) return false;
  if (it->is_string()) return truthy_text(it->get<std::string>());
  return truthy(*it);
}

// `item.get(key) or {}` as an object (anything else: no parameters)
const Json& parameters_of(const Json& item) {
  static const Json empty = Json::object();
  auto it = item.find("parameters");
  if (it == item.end() || !it->is_object()) return empty;
  return *it;
}

// Python's str() of a JSON value in a message
std::string py_str(const Json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "True" : "False";
  if (value.is_null()) return "None";
  return value.dump();
}

float to_float(double value) {
  // a double past float's range rounds to infinity (a plain cast would be undefined)
  constexpr double kHalfPastMax = 3.4028235677973366e38;
  if (value >= kHalfPastMax) return std::numeric_limits<float>::infinity();
  if (value <= -kHalfPastMax) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(value);
}

float half_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000) << 16;
  const uint32_t exponent = (half >> 10) & 0x1f, mantissa = half & 0x3ff;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int shift = 0;
      uint32_t m = mantissa;
      while (!(m & 0x400)) {
        m <<= 1;
        ++shift;
      }
      bits = sign | ((127 - 15 - shift + 1) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// ------------------------------------------------------------------------------------------ infer body
// Python's int() of a header value: optional spaces and sign, then digits (saturated past 18 of them)
bool parse_int(const std::string& text, int64_t& value) {
  const size_t b = text.find_first_not_of(" \t"), e = text.find_last_not_of(" \t");
  if (b == std::string::npos) return false;
  const std::string t = text.substr(b, e - b + 1);
  const size_t digits = (t[0] == '+' || t[0] == '-') ? 1 : 0;
  if (digits == t.size() || t.find_first_not_of("0123456789", digits) != std::string::npos) return false;
  if (t.size() - digits > 18) {
    value = t[0] == '-' ? INT64_MIN : INT64_MAX;
    return true;
  }
  value = std::stoll(t);
  return true;
}

// one JSON element kind, torch.tensor's inference: bool < int < float; anything else is no number
enum class Kind { Bool, Int, Float, Bad };

// The leaves of `data` in row-major order if it is a rectangular nest of numbers (torch.tensor(values) accepts
// it), with their widest kind.
bool flatten(const Json& data, std::vector<const Json*>& leaves, Kind& kind, std::vector<size_t>& dims, size_t depth) {
  if (data.is_array()) {
    if (dims.size() == depth) {
      if (!leaves.empty() && depth > 0) return false;  // a list where a number was
      dims.push_back(data.size());
    } else if (dims.size() < depth + 1 || dims[depth] != data.size()) {
      return false;  // ragged
    }
    for (const auto& item : data)
      if (!flatten(item, leaves, kind, dims, depth + 1)) return false;
    if (data.empty() && kind == Kind::Bool) kind = Kind::Float;  // torch.tensor([[]]) is float32
    return true;
  }
  if (dims.size() != depth) return false;  // a number where a list was
  Kind k;
  if (data.is_boolean()) {
    k = Kind::Bool;
  } else if (data.is_number_unsigned()) {  // (nlohmann's is_number_integer() holds for these too)
    k = data.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) ? Kind::Bad : Kind::Int;  // torch: Overflow
  } else if (data.is_number_integer()) {
    k = Kind::Int;
  } else if (data.is_number_float()) {
    k = Kind::Float;
  } else {
    k = Kind::Bad;
  }
  if (k == Kind::Bad) return false;
  kind = std::max(kind, k);
  leaves.push_back(&data);
  return true;
}

// an integer (or bool) JSON value; past int64 saturated
int64_t integer_of(const Json& leaf) {
  if (leaf.is_boolean()) return leaf.get<bool>() ? 1 : 0;
  if (leaf.is_number_unsigned()) return static_cast<int64_t>(std::min<uint64_t>(leaf.get<uint64_t>(), INT64_MAX));
  return leaf.get<int64_t>();
}

// codec.tensor_from_values: an input whose data came as JSON numbers, row-major
OipInput tensor_from_values(const std::string& name, const std::string& datatype, const std::vector<int64_t>& dims,
                            const Json& values, Request& request) {
  __int128 exact = 0;
  checked_count(name, datatype, dims, exact);
  const std::string not_numbers = "input " + py_repr(name) + ": its data are not " + datatype + " numbers";
  std::vector<const Json*> leaves;
  Kind kind = Kind::Bool;
  std::vector<size_t> nest;
  if (values.is_array()) {
    if (!values.empty() && !flatten(values, leaves, kind, nest, 0)) throw BadRequest(not_numbers);
  } else if (!(values.is_object() && values.empty())) {
    throw BadRequest(not_numbers);
  }
  const bool floating = datatype == "FP32" || datatype == "FP16";
  if (!leaves.empty() || (values.is_array() && !values.empty())) {
    if (kind == Kind::Bool) throw BadRequest(not_numbers + " (got bool)");
    if (kind == Kind::Float && !floating) throw BadRequest(not_numbers + " (got float32)");
  }
  const int width = oip_width(datatype);
  request.storage.emplace_back(leaves.size() * static_cast<size_t>(width));
  char* out = request.storage.back().data();
  for (size_t i = 0; i < leaves.size(); ++i) {
    const Json& leaf = *leaves[i];
    if (datatype == "INT64") {
      const int64_t v = integer_of(leaf);
      std::memcpy(out + i * 8, &v, 8);
    } else if (datatype == "INT32") {
      const int64_t v = integer_of(leaf);
      if (v < INT32_MIN || v > INT32_MAX) throw BadRequest("input " + py_repr(name) + ": its data do not fit in INT32");
      const int32_t narrow = static_cast<int32_t>(v);
      std::memcpy(out + i * 4, &narrow, 4);
    } else if (datatype == "FP32") {
      const float v = leaf.is_number_float() ? to_float(leaf.get<double>()) : static_cast<float>(integer_of(leaf));
      std::memcpy(out + i * 4, &v, 4);
    }  // FP16: no input takes it (decode refuses it by name); its count is still checked below
  }
  const int64_t given = static_cast<int64_t>(leaves.size());
  if (static_cast<__int128>(given) != exact)
    throw BadRequest("input " + py_repr(name) + ": " + std::to_string(given) + " elements for shape " +
                     shape_text(dims) + " (expected " + wide(exact) + ")");
  return {name, datatype, dims, Array{out, width, given}};
}

struct InferBody {
  Json request;
  std::vector<OipInput> inputs;
  std::vector<OipOutput> requested;
  std::map<std::string, bool> binary_of;  // outputs that said binary_data
  bool binary_default = false, fp16 = false;
};

// rest_server.parse_infer_body: the JSON header (+ binary tensors) of an infer request
InferBody parse_infer_body(const std::string& body, const httplib::Request& http, Request& request) {
  size_t split = body.size();
  if (http.has_header(kHeaderLength)) {
    int64_t given = 0;
    if (!parse_int(last_header(http, kHeaderLength), given))
      throw BadRequest("Inference-Header-Content-Length is not a number");
    if (given < 0 || static_cast<uint64_t>(given) > body.size())
      throw BadRequest("Inference-Header-Content-Length " + std::to_string(given) + " exceeds the body's " +
                       std::to_string(body.size()) + " bytes");
    split = static_cast<size_t>(given);
  }
  const char* binary = body.data() + split;
  const size_t binary_size = body.size() - split;
  InferBody parsed;
  check_json_depth(body.data(), body.data() + split);
  try {
    parsed.request = Json::parse(body.begin(), body.begin() + static_cast<std::ptrdiff_t>(split));
  } catch (const Json::exception& err) {
    std::string what = err.what();
    const size_t close = what.find("] ");
    throw BadRequest("the request is not valid JSON: " + (close == std::string::npos ? what : what.substr(close + 2)));
  }
  const Json& json = parsed.request;
  if (!json.is_object() || !json.contains("inputs") || !json["inputs"].is_array())
    throw BadRequest("the request must be a JSON object with an 'inputs' list");
  static const Json empty = Json::object();
  const Json& parameters = json.contains("parameters") && truthy(json["parameters"]) ? json["parameters"] : empty;
  if (!parameters.is_object()) throw BadRequest("'parameters' must be a JSON object");
  size_t offset = 0;
  size_t index = 0;
  for (const Json& item : json["inputs"]) {
    if (!item.is_object() || !item.contains("name") || !item["name"].is_string())
      throw BadRequest("input #" + std::to_string(index) + " must be an object with a 'name'");
    const std::string name = item["name"].get<std::string>();
    std::string datatype;
    if (item.contains("datatype")) datatype = item["datatype"].is_string() ? item["datatype"].get<std::string>()
                                                                           : py_str(item["datatype"]);
    std::vector<int64_t> dims;
    const Json* shape = item.contains("shape") ? &item["shape"] : nullptr;
    if (shape == nullptr || !shape->is_array())
      throw BadRequest("input " + py_repr(name) + ": 'shape' must be a list of integers");
    for (const Json& d : *shape) {
      if (d.is_number_integer() || d.is_boolean()) {  // unsigned too
        dims.push_back(integer_of(d));
      } else {
        throw BadRequest("input " + py_repr(name) + ": 'shape' must be a list of integers");
      }
    }
    const Json& input_parameters = parameters_of(item);
    auto size_it = input_parameters.find("binary_data_size");
    if (size_it != input_parameters.end() && !size_it->is_null()) {
      const Json& size = *size_it;
      const bool integral = size.is_number_integer() || size.is_boolean();  // unsigned too
      const int64_t n = integral ? integer_of(size) : -1;
      if (!integral || n < 0 || static_cast<uint64_t>(n) > binary_size - offset)
        throw BadRequest("input " + py_repr(name) + ": binary_data_size " + py_str(size) +
                         " runs past the request's binary data");
      // codec.tensor_from_raw
      __int128 exact = 0;
      const int64_t count = checked_count(name, datatype, dims, exact);
      const int width = oip_width(datatype);
      if (static_cast<__int128>(n) != exact * width)
        throw BadRequest("input " + py_repr(name) + ": " + std::to_string(n) + " bytes of raw data for shape " +
                         shape_text(dims) + " " + datatype + " (expected " + wide(exact * width) + " bytes)");
      parsed.inputs.push_back({name, datatype, dims, Array{request.aligned(binary + offset, n, width), width, count}});
      offset += static_cast<size_t>(n);
    } else if (item.contains("data")) {
      parsed.inputs.push_back(tensor_from_values(name, datatype, dims, item["data"], request));
    } else {
      throw BadRequest("input " + py_repr(name) + " carries no 'data' and no binary_data_size");
    }
    ++index;
  }
  if (offset != binary_size)
    throw BadRequest(std::to_string(binary_size - offset) + " bytes of binary data belong to no input");
  parsed.binary_default = flag(parameters, "binary_data_output");
  parsed.fp16 = flag(parameters, "output_fp16");
  if (json.contains("outputs") && truthy(json["outputs"])) {
    const Json& outputs = json["outputs"];
    if (!outputs.is_array()) throw BadRequest("output #0 must be an object with a 'name'");
    index = 0;
    for (const Json& item : outputs) {
      if (!item.is_object() || !item.contains("name") || !item["name"].is_string())
        throw BadRequest("output #" + std::to_string(index) + " must be an object with a 'name'");
      const std::string name = item["name"].get<std::string>();
      const Json& output_parameters = parameters_of(item);
      parsed.requested.push_back({name, parsed.fp16 || flag(output_parameters, "output_fp16")});
      if (output_parameters.contains("binary_data")) parsed.binary_of[name] = flag(output_parameters, "binary_data");
      ++index;
    }
  }
  return parsed;
}

// Python's floats of one output's values, as JSON numbers (float32 values printed as doubles are exact)
Json values_of(const char* data, int64_t count, bool fp16) {
  Json out = Json::array();
  out.get_ref<Json::array_t&>().reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    float v;
    if (fp16) {
      uint16_t h;
      std::memcpy(&h, data + i * 2, 2);
      v = half_to_float(h);
    } else {
      std::memcpy(&v, data + i * 4, 4);
    }
    out.push_back(static_cast<double>(v));
  }
  return out;
}

Json statistics_json(const std::string& name, const std::string& version, const StatisticsSnapshot& s) {
  auto duration = [](const Duration& d) { return Json{{"count", d.count}, {"ns", d.ns}}; };
  Json batches = Json::array();
  for (const auto& [examples, b] : s.batches)
    batches.push_back({{"batch_size", examples},
                       {"compute_input", duration(b.compute_input)},
                       {"compute_infer", duration(b.compute_infer)},
                       {"compute_output", duration(b.compute_output)}});
  return Json{{"name", name},
              {"version", version},
              {"last_inference", s.last_inference_ms},
              {"inference_count", s.inference_count},
              {"execution_count", s.execution_count},
              {"inference_stats",
               {{"success", duration(s.success)},
                {"fail", duration(s.fail)},
                {"queue", duration(s.queue)},
                {"compute_input", duration(s.compute_input)},
                {"compute_infer", duration(s.compute_infer)},
                {"compute_output", duration(s.compute_output)}}},
              {"batch_stats", batches}};
}

const std::regex& model_path() {
  static const std::regex pattern("^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/infer|/config|/stats)?$");
  return pattern;
}
const std::regex& repository_path() {
  static const std::regex pattern("^/v2/repository/models/([^/]+)/(load|unload)$");
  return pattern;
}

}  // namespace

HttpServer::HttpServer(Service& service, Metrics& metrics, HttpOptions options)
    : service_(service), metrics_(metrics), options_(std::move(options)) {}

HttpServer::~HttpServer() {
  if (server_) server_->stop();
  if (listener_.joinable()) listener_.join();
}

int HttpServer::start() {
  if (!options_.tls_cert.empty()) {
    auto tls = std::make_unique<httplib::SSLServer>(options_.tls_cert.c_str(), options_.tls_key.c_str());
    if (!tls->is_valid())
      throw std::runtime_error("cannot serve HTTPS with --tls-cert " + options_.tls_cert + " and --tls-key " +
                               options_.tls_key + " (not a PEM certificate and its key?)");
    server_ = std::move(tls);
  } else {
    server_ = std::make_unique<httplib::Server>();
  }
  httplib::Server& server = *server_;
  const int threads = options_.threads > 0 ? options_.threads : 64;
  server.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  // httplib sets SO_REUSEPORT by default: a second server could share a port that serves; as gRPC, only if asked
  const bool reuse_port = options_.reuse_port;
  server.set_socket_options([this, reuse_port](int sock) {
    listen_fd_ = sock;  // called for the listening socket only (the last one tried is the one bound)
    int one = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (reuse_port) setsockopt(sock, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // accepted sockets inherit it
  });
  server.set_tcp_nodelay(true);
  server.set_keep_alive_max_count(std::numeric_limits<int>::max());
  server.set_keep_alive_timeout(30);
  server.set_read_timeout(60, 0);
  server.set_write_timeout(60, 0);
  server.set_payload_max_length(static_cast<size_t>(options_.max_body));
  // HTTP itself refused (rest_server.read_request's HttpError): answered, then the connection closes
  const int64_t max_body = options_.max_body;
  server.set_pre_routing_handler([this, max_body](const httplib::Request& request, httplib::Response& response) {
    auto refuse = [&](int status, const std::string& message) {
      put_error(response, status, message);
      response.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    };
    // rest_server.read_request reads at most 100 header lines (httplib adds REMOTE_ADDR, REMOTE_PORT, LOCAL_ADDR and
    // LOCAL_PORT to those the client sent)
    if (request.headers.size() >= kMaxHeaderLines + 4)
      return refuse(431, "more than " + std::to_string(kMaxHeaderLines) + " header lines");
    std::string transfer = last_header(request, "Transfer-Encoding");
    std::transform(transfer.begin(), transfer.end(), transfer.begin(), [](unsigned char c) { return std::tolower(c); });
    if (transfer.find("chunked") != std::string::npos)
      return refuse(411, "chunked request bodies are not supported; send Content-Length");
    if (request.has_header("Content-Length")) {
      // two lengths that disagree frame the body two ways (RFC 9112 6.3): refused, as the Python server does
      const std::string given = request.get_header_value("Content-Length");
      for (size_t i = 1; i < request.get_header_value_count("Content-Length"); ++i)
        if (request.get_header_value("Content-Length", i) != given)
          return refuse(400, "Content-Length is given twice with different values");
      int64_t length = 0;
      if (!parse_int(given, length))
        return refuse(400, "Content-Length is not a number");
      if (length < 0 || length > max_body)
        return refuse(413, "request body of " + std::to_string(length) + " bytes exceeds the server's limit of " +
                               std::to_string(max_body) + " bytes (--max-message-mb)");
    }
    std::string encoding = last_header(request, "Content-Encoding");
    std::transform(encoding.begin(), encoding.end(), encoding.begin(), [](unsigned char c) { return std::tolower(c); });
    if (!encoding.empty() && encoding != "identity" && encoding != "gzip" && encoding != "deflate")
      return refuse(415, "Content-Encoding " + py_repr(encoding) + " is not supported");
    if (!request.has_header("Content-Length")) {
      // no body (the Python server reads none without a length); httplib would read one until the client hangs up
      const std::string& m = request.method;
      if (m == "POST" || m == "PUT" || m == "PATCH" || m == "DELETE" || m == "PRI") {
        respond(request, response);
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // what httplib refused on its own (a malformed request line or header, a body it could not read): JSON words
  server.set_error_handler(httplib::Server::HandlerWithResponse(
      [max_body](const httplib::Request& request, httplib::Response& response) {
    // our own answers (routed: the catch-all pattern matched) keep their body, or their empty one (health, ready)
    if (!response.body.empty() || !request.matches.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string message;
    switch (response.status) {
      case 400: message = "malformed HTTP request"; break;
      case 413: message = "request body exceeds the server's limit of " + std::to_string(max_body) +
                          " bytes (--max-message-mb)"; break;
      case 414: message = "request line too long"; break;
      case 415: message = "Content-Encoding is not supported"; break;
      default: message = "the HTTP request could not be read"; break;
    }
    put_error(response, response.status, message);
    response.set_header("Connection", "close");
    return httplib::Server::HandlerResponse::Handled;
  }));
  // what escaped respond() (it answers every refusal itself): the generic words and a request id, never httplib's
  // default (a 500 whose EXCEPTION_WHAT header tells the client our internals)
  server.set_exception_handler([](const httplib::Request&, httplib::Response& response, std::exception_ptr error) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& err) {
      what = err.what();
    } catch (...) {
    }
    const std::string id = log_internal("REST", what.c_str());
    put_error(response, 500, "internal error (request id " + id + "); see the server log");
  });
  auto handler = [this](const httplib::Request& request, httplib::Response& response) { respond(request, response); };
  server.Get(".*", handler);
  server.Post(".*", handler);
  server.Put(".*", handler);
  server.Delete(".*", handler);
  server.Patch(".*", handler);
  server.Options(".*", handler);
  int port = options_.port;
  if (port == 0) {
    port = server.bind_to_any_port(options_.host);
    if (port < 0) port = 0;
  } else if (!server.bind_to_port(options_.host, port)) {
    port = 0;
  }
  if (port == 0)
    throw std::runtime_error("cannot bind the HTTP port " + options_.host + ":" + std::to_string(options_.port));
  listener_ = std::thread([this] { server_->listen_after_bind(); });
  return port;
}

void HttpServer::stop_accepting() {
  closing_ = true;
  // The listening socket stops listening (a new connection is refused, httplib's accept loop ends) but is not
  // httplib's stop(): that marks the server socket gone, and every connection's keep-alive loop then closes its
  // connection after the answer it is writing, though that answer (given before closing_) said keep-alive and its
  // client may be sending the next request (a reset: lost). Open connections keep being served, each answer now
  // closing its connection, until the process leaves (main.cpp: kRestLingerS).
  const int fd = listen_fd_.exchange(-1);
  if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

bool HttpServer::authorized(const httplib::Request& request, const std::string& path) const {
  if (options_.auth_token.empty() || path.rfind("/v2/health/", 0) == 0) return true;
  return constant_time_equal(last_header(request, "Authorization"), "Bearer " + options_.auth_token);
}

// rest_server._respond: authorize, route, answer; every refusal a status and {"error": words}; counted in metrics
void HttpServer::respond(const httplib::Request& request, httplib::Response& response) {
  const auto started = Clock::now();
  struct Counted {  // in flight until answered, however respond() ends
    std::atomic<int64_t>& count;
    explicit Counted(std::atomic<int64_t>& c) : count(c) { ++count; }
    ~Counted() { --count; }
  } counted(in_flight_);
  std::string operation = "REST";
  const char* code = "OK";
  const char* reason = "";
  const std::string path = request.target.substr(0, request.target.find('?'));
  if (path.rfind("/v2/health/", 0) != 0) service_.last_arrival_ns_ = started.time_since_epoch().count();
  try {
    if (!authorized(request, path)) throw Refusal{"UNAUTHENTICATED", 401,
                                                  "missing or wrong bearer token (header 'Authorization')", ""};
    route(request, response, operation);
  } catch (const Refusal& refusal) {
    code = refusal.code, reason = refusal.reason;
    put_error(response, refusal.status, refusal.message);
  } catch (const ModelSetError& err) {  // rest_server: NOT_FOUND is 404, the repository's other refusals 400
    const bool missing = err.code == ModelSetError::Code::NotFound;
    code = missing ? "NOT_FOUND"
                   : err.code == ModelSetError::Code::FailedPrecondition ? "FAILED_PRECONDITION" : "INVALID_ARGUMENT";
    reason = err.reason;
    put_error(response, missing ? 404 : 400, err.what());
  } catch (const BadRequest& err) {
    code = "INVALID_ARGUMENT", reason = "invalid";
    put_error(response, 400, err.what());
  } catch (const std::exception& err) {
    const std::string id = log_internal(operation, err.what());
    code = "INTERNAL", reason = "internal";
    put_error(response, 500, "internal error (request id " + id + "); see the server log");
  }
  if (*reason) metrics_.rejected(reason);
  metrics_.call(operation, code, std::chrono::duration<double>(Clock::now() - started).count());
  if (closing_)
    response.set_header("Connection", "close");
  else
    kept_alive_ns_ = Clock::now().time_since_epoch().count();
}

// rest_server._route
void HttpServer::route(const httplib::Request& request, httplib::Response& response, std::string& operation) {
  const std::string raw = request.target.substr(0, request.target.find('?'));
  std::string path = raw;
  while (!path.empty() && path.back() == '/') path.pop_back();
  if (path.empty()) path = "/";
  const std::string& method = request.method;
  ModelSet& models = service_.models();  // ModelSetError NotFound for an unknown model or version
  if (method == "GET" && (path == "/v2/health/live" || path == "/v2/health/ready")) {
    operation = "REST health";
    const bool ok = path == "/v2/health/live" || service_.oip_ready();
    response.status = ok ? 200 : 503;
    return;
  }
  if (method == "GET" && path == "/v2") {
    operation = "REST ServerMetadata";
    return put_json(response, Json{{"name", "embserve"},
                                   {"version", EMBSERVE_VERSION},
                                   {"extensions", {"binary_tensor_data", "model_repository", "model_configuration",
                                                   "statistics"}}});
  }
  // OipCore.model_statistics: every loaded version of every model (no name), of one model (no version), or one
  auto statistics = [&](const std::string& name, const std::string& version) {
    std::vector<std::shared_ptr<ServedVersion>> served;
    if (name.empty()) {
      served = models.served();
    } else if (!version.empty()) {
      served.push_back(models.find(name, version));
    } else {
      for (const auto& v : models.versions(name)) served.push_back(models.find(name, v));
    }
    Json stats = Json::array();
    for (const auto& model : served) stats.push_back(statistics_json(model->name, model->version, model->statistics.snapshot()));
    return Json{{"model_stats", std::move(stats)}};
  };
  if (method == "GET" && path == "/v2/models/stats") {
    operation = "REST ModelStatistics";
    return put_json(response, statistics("", ""));
  }
  std::smatch match;
  if (std::regex_match(path, match, model_path())) {
    const std::string name = unquote(match[1]), version = unquote(match[2]), action = match[3];
    if (method == "GET" && action.empty()) {
      operation = "REST ModelMetadata";
      // OipCore.model_metadata: the model's loaded versions, and the ones that failed to load with why
      const std::shared_ptr<ServedVersion> model = models.find(name, version);
      Json metadata = Json::parse(model->oip_metadata_json);
      metadata["versions"] = models.versions(name);
      const auto failures = models.failures(name);
      if (!failures.empty()) metadata["properties"]["failed_versions"] = python_json(failures);
      return put_json(response, metadata);
    }
    if (method == "GET" && action == "/config") {
      operation = "REST ModelConfig";
      const std::shared_ptr<ServedVersion> model = models.find(name, version);
      response.status = 200;
      return response.set_content(model->oip_config_json, "application/json");
    }
    if (method == "GET" && action == "/stats") {
      operation = "REST ModelStatistics";
      return put_json(response, statistics(name, version));
    }
    if (method == "GET" && action == "/ready") {
      operation = "REST ModelReady";
      const bool ready = service_.oip_ready() && models.ready(name, version);
      response.status = ready ? 200 : 400;
      return;
    }
    if (method == "POST" && action == "/infer") {
      operation = "REST ModelInfer";
      return infer(name, version, request, response);
    }
  }
  if (method == "POST" && path == "/v2/repository/index") {
    operation = "REST RepositoryIndex";
    Json options = Json::object();
    const bool blank = request.body.find_first_not_of(" \t\r\n\f\v") == std::string::npos;
    if (!blank) {
      check_json_depth(request.body.data(), request.body.data() + request.body.size());
      try {
        options = Json::parse(request.body);
      } catch (const Json::exception& err) {
        std::string what = err.what();
        const size_t close = what.find("] ");
        throw BadRequest("the repository index request is not valid JSON: " +
                         (close == std::string::npos ? what : what.substr(close + 2)));
      }
    }
    if (!options.is_object() || (options.contains("ready") && !options["ready"].is_boolean()))
      throw BadRequest("the repository index request must be a JSON object like {\"ready\": true}");
    Json index = Json::array();
    for (const auto& entry : models.index(options.value("ready", false)))
      index.push_back(
          Json{{"name", entry.name}, {"version", entry.version}, {"state", entry.state}, {"reason", entry.reason}});
    return put_json(response, index);
  }
  if (method == "POST" && std::regex_match(path, match, repository_path())) {
    const std::string name = unquote(match[1]);
    const bool load = match[2] == "load";
    operation = load ? "REST RepositoryModelLoad" : "REST RepositoryModelUnload";
    // blocking (a load verifies and warms a version: seconds): on this connection's worker thread, never on the
    // listener's, so other connections are answered meanwhile
    if (load)
      models.load(name);
    else
      models.unload(name);
    return put_json(response, Json::object());
  }
  throw Refusal{"NOT_FOUND", 404, "no route " + method + " " + raw + "; see the /v2 routes in the README", "no_route"};
}

// rest_server._infer + OpenInference.infer: parse, accept, find, decode and validate once, batch, answer
void HttpServer::infer(const std::string& name, const std::string& version, const httplib::Request& http,
                       httplib::Response& response) {
  struct InFlight {
    Service& service;
    explicit InFlight(Service& s) : service(s) { ++service.in_flight_; }
    ~InFlight() { --service.in_flight_; }
  } in_flight(service_);
  Request request;
  InferBody body = parse_infer_body(http.body, http, request);
  const auto started = Clock::now();
  if (!service_.ready_) throw Refusal{"UNAVAILABLE", 503, "the server is warming up; retry shortly", "warming_up"};
  if (service_.closing_) throw Refusal{"UNAVAILABLE", 503, kDraining, "draining"};
  // the version this request runs on, held until it is answered (a swap never waits for it)
  const std::shared_ptr<ServedVersion> model = service_.models().find(name, version);
  auto ns = [](Clock::duration d) { return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(); };
  Call call;
  try {
    const ModelShape& shape = model->shape();
    const auto decoding = Clock::now();
    decode_oip_inputs(body.inputs, shape, request);
    const OipOutputs chosen =
        choose_oip_outputs(body.requested, shape.num_dense_features > 0, request.dense != nullptr, body.fp16);
    metrics_.stage("decode", std::chrono::duration<double>(Clock::now() - decoding).count());
    const int64_t max_batch = service_.options_.max_batch_size;
    if (request.batch > max_batch) throw BadRequest(too_large(request.batch, max_batch));
    const auto decoded = Clock::now();
    // the answer: a JSON header, then the binary outputs; when every output is binary, the forward writes them
    // straight into the body, after the header
    const int64_t batch = request.batch;
    struct Out {
      std::string name, datatype;
      std::vector<int64_t> shape;
      size_t bytes;
      bool binary, fp16;
    };
    std::vector<Out> outs;
    bool all_binary = true;
    for (const auto& o : chosen.outputs) {
      const bool binary = body.binary_of.count(o.name) ? body.binary_of[o.name] : body.binary_default;
      all_binary = all_binary && binary;
      if (o.name == kOipEmbeddings)
        outs.push_back({o.name, o.fp16 ? "FP16" : "FP32", {batch, shape.output_dim},
                        static_cast<size_t>(batch * shape.output_dim) * (o.fp16 ? 2 : 4), binary, o.fp16});
      else
        outs.push_back({o.name, "FP32", {batch}, static_cast<size_t>(batch) * 4, binary, false});
    }
    auto header = [&](const std::vector<const char*>& data) {
      Json payload = {{"model_name", model->name}, {"model_version", model->version}};
      if (body.request.contains("id")) payload["id"] = body.request["id"];
      Json outputs = Json::array();
      for (size_t i = 0; i < outs.size(); ++i) {
        Json entry = {{"name", outs[i].name}, {"datatype", outs[i].datatype}, {"shape", outs[i].shape}};
        if (outs[i].binary) {
          entry["parameters"] = {{"binary_data_size", outs[i].bytes}};
        } else {
          const int64_t count = static_cast<int64_t>(outs[i].bytes / (outs[i].fp16 ? 2 : 4));
          entry["data"] = values_of(data[i], count, outs[i].fp16);
        }
        outputs.push_back(std::move(entry));
      }
      payload["outputs"] = std::move(outputs);
      return dumped(payload);
    };
    std::string out;                  // the body, when every output is binary
    std::vector<std::vector<char>> scratch(outs.size());  // else each output's bytes
    std::vector<char*> where(outs.size());
    size_t header_size = 0;
    if (all_binary) {
      const std::string head = header({});
      header_size = head.size();
      size_t total = head.size();
      for (const auto& o : outs) total += o.bytes;
      out.reserve(total);
      out = head;
      out.resize(total);
      size_t at = head.size();
      for (size_t i = 0; i < outs.size(); ++i) where[i] = out.data() + at, at += outs[i].bytes;
    } else {
      for (size_t i = 0; i < outs.size(); ++i) scratch[i].resize(outs[i].bytes), where[i] = scratch[i].data();
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].name == kOipEmbeddings) {
        call.embeddings = where[i];
        call.embeddings_fp16 = outs[i].fp16;
      } else {
        call.scores = reinterpret_cast<float*>(where[i]);
      }
    }
    std::mutex mutex;
    std::condition_variable answered;
    bool finished = false;
    Outcome outcome = Outcome::Ok;
    std::string message;
    call.request = &request;
    call.done = [&](Outcome o, const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex);
      outcome = o;
      message = m;
      finished = true;
      answered.notify_one();
    };
    Batcher* batcher = model->lookups.get();
    if (!chosen.scores) {
      request.dense = nullptr;
    } else {
      batcher = chosen.embeddings ? model->both.get() : model->predictions.get();
    }
    if (!batcher->submit(&call))
      throw Refusal{"RESOURCE_EXHAUSTED", 429,
                    "the request queue is full (" + std::to_string(service_.options_.batching.max_queue) +
                        " requests); retry later",
                    "queue_full"};
    {
      std::unique_lock<std::mutex> lock(mutex);
      answered.wait(lock, [&] { return finished; });
    }
    if (outcome == Outcome::BadRequest) throw BadRequest(message);
    if (outcome == Outcome::Internal) throw std::runtime_error(message);
    if (all_binary) {
      response.set_header(kHeaderLength, std::to_string(header_size));
      response.set_content(std::move(out), "application/octet-stream");
    } else {
      std::vector<const char*> data(where.begin(), where.end());
      std::string head = header(data);
      std::string blobs;
      for (size_t i = 0; i < outs.size(); ++i)
        if (outs[i].binary) blobs.append(scratch[i].data(), scratch[i].size());
      response.status = 200;
      if (blobs.empty()) {
        response.set_content(std::move(head), "application/json");
      } else {
        response.set_header(kHeaderLength, std::to_string(head.size()));
        response.set_content(head + blobs, "application/octet-stream");
      }
    }
    response.status = 200;
    // the statistics extension: from arrival to the answer; input stage decoding and merge, output the split and
    // the answer's encoding
    const auto now = Clock::now();
    const StageTimes& t = call.timing;
    model->statistics.request_succeeded(batch, ns(now - started), t.queue_ns, ns(decoded - started) + t.merge_ns,
                                           t.forward_ns, t.split_ns + ns(now - t.answered));
  } catch (...) {
    model->statistics.request_failed(ns(Clock::now() - started));
    throw;
  }
}

}  // namespace embserve::server
