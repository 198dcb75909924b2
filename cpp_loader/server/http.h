// The Open Inference Protocol over HTTP/REST in embserve-server (--http-port): server/adapters/oip/rest_server.py's
// routes, status codes, JSON error bodies and words, on cpp-httplib (Debian's libcpp-httplib-dev). Requests are
// decoded with the gRPC handlers' rules (oip_codec.h, request.h); each finds its model version in the service's
// ModelSet (model_set.h), holds it until answered and runs on its batchers and statistics; the repository
// routes load and unload through the same ModelSet. Plain C++ and JSON: no torch, no protobuf in the handlers' path.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace embserve::server {

class Service;
class Metrics;

struct HttpOptions {
  std::string host = "0.0.0.0";
  int port = 0;                   // 0: a free port
  std::string tls_cert, tls_key;  // PEM files: HTTPS when both are given
  std::string auth_token;         // empty: no token required (health stays open either way)
  int64_t max_body = 64 << 20;    // request bodies past this are 413
  int threads = 0;                // connection threads (one per open connection); 0: a default
  bool reuse_port = false;
};

class HttpServer {
 public:
  HttpServer(Service& service, Metrics& metrics, HttpOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Bind and serve on a thread of its own; returns the port. std::runtime_error when the port cannot be bound.
  int start();
  // The first step of a stop: the listening socket stops listening and every answer from now on closes its
  // connection (connections already open are still served: a client may be sending on one).
  void stop_accepting();
  // Requests being answered (a stop waits for them).
  int64_t in_flight() const { return in_flight_; }
  // Seconds since the last answer that kept its connection alive (none after stop_accepting): its client may be
  // sending the next request on that connection, so the process waits a while before it exits.
  double seconds_since_kept_alive() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch() -
                                         std::chrono::steady_clock::duration(kept_alive_ns_.load()))
        .count();
  }

 private:
  void respond(const httplib::Request& request, httplib::Response& response);
  void route(const httplib::Request& request, httplib::Response& response, std::string& operation);
  void infer(const std::string& name, const std::string& version, const httplib::Request& request,
             httplib::Response& response);
  bool authorized(const httplib::Request& request, const std::string& path) const;

  Service& service_;
  Metrics& metrics_;
  HttpOptions options_;
  std::unique_ptr<httplib::Server> server_;
  std::thread listener_;
  std::atomic<bool> closing_{false};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<std::chrono::steady_clock::rep> kept_alive_ns_{0};
  std::atomic<int> listen_fd_{-1};
};

}  // namespace embserve::server
