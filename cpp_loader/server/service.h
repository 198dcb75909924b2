// The gRPC front end of embserve-server: embserve.v1.InferenceService and inference.GRPCInferenceService on
// grpc's async completion-queue API (one generic service: every call's bytes are decoded here, so bytes that are
// no valid message are INVALID_ARGUMENT in Python's words, not grpc's INTERNAL). Handlers see plain C++ types
// of the model (runner.h); calls go through the batchers (batcher.h) and are answered from the forward threads.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "batcher.h"
#include "health.h"
#include "metrics.h"
#include "model_set.h"
#include "runner.h"
#include "statistics.h"

namespace embserve::server {

struct ServiceOptions {
  int64_t max_batch_size = 4096;
  std::string auth_token;  // empty: no token required
  BatcherSettings batching;
};

class Service {
 public:
  Service(ServiceOptions options, Metrics* metrics);
  ~Service();
  // A loaded runner as a version the service can serve: its batchers (reporting to this service's metrics and
  // overlap rule), statistics and metadata. The caller warms it (warm_up) before it serves.
  std::shared_ptr<ServedVersion> build_version(std::unique_ptr<Runner> runner, ModelInfo info, const std::string& name,
                                               const std::string& version) const;
  // What the service serves (before start; lives as long as the service).
  void set_models(ModelSet* models) { models_ = models; }
  void register_with(grpc::ServerBuilder& builder);
  // Start `threads` completion-queue threads (after BuildAndStart); each owns one queue filled in register_with.
  void start(grpc::Server* server);
  void set_ready(bool ready) { ready_ = ready; }
  // The Open Inference Protocol's readiness: ready and not draining.
  bool oip_ready() const { return ready_ && serving_; }
  // The drain began: NOT_SERVING (model calls are still answered until begin_closing).
  void stop_serving() { serving_ = false; }
  // Calls read and not yet finished on the wire (the process may exit once none is left).
  int64_t open_calls() const { return open_calls_; }
  // Refuse new model calls (UNAVAILABLE) and run waiting batches at once.
  void begin_closing();
  int64_t in_flight() const { return in_flight_; }
  double seconds_since_last_call() const;
  // After server->Shutdown: stop the queues and join their threads.
  void stop();
  double queue_depth() const;
  // grpc.health.v1, served on the completion queues (health.h)
  Health& health() { return health_; }
  int completion_queues = 1;  // set before register_with

  class Call;  // one call's state (service.cpp)

 private:
  friend class Call;
  friend class HttpServer;  // the REST front end (http.h): the same models, metrics and state
  std::atomic<ModelSet*> models_{nullptr};  // read by forward threads (the overlap rule)
  ServiceOptions options_;
  Metrics* metrics_;
  grpc::AsyncGenericService generic_;
  Health health_;
  std::vector<std::unique_ptr<grpc::Service>> listed_;  // the services' names, for reflection
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> threads_;
  std::atomic<bool> ready_{false}, closing_{false}, serving_{true};
  std::atomic<int64_t> open_calls_{0};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> last_arrival_ns_{0};
  std::string server_metadata_;

  void poll(grpc::ServerCompletionQueue* queue);
  void arm(grpc::ServerCompletionQueue* queue);
  int64_t arriving() const;
  ModelSet& models() const { return *models_.load(); }
};

// Warm-up: `batches` forwards of a new version straight on its runner (before it serves); RunnerError when one
// fails or answers non-finite embeddings (a version that would answer garbage never serves).
void warm_up(const ServedVersion& model, int batches, int64_t max_batch_size);

}  // namespace embserve::server
