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
#include "metrics.h"
#include "runner.h"
#include "statistics.h"

namespace embserve::server {

// What the metadata of the served model says beyond the runner's shape (read from manifest.json).
struct TableInfo {
  std::string name;
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  std::string data_type;
  std::string pooling;
  std::vector<std::string> feature_names;
};
struct ModelInfo {
  std::string name;     // the OIP model name (--model-name, else the artifact folder's name)
  std::string sha256;   // the model file's
  std::string version;  // its first 16 hex digits
  int format_version = 0;
  std::vector<TableInfo> tables;
  std::vector<std::string> devices;
  int world_size = 1;
};
ModelInfo read_model_info(const std::string& artifact_dir, const std::string& model_name);

struct ServiceOptions {
  int64_t max_batch_size = 4096;
  std::string auth_token;  // empty: no token required
  BatcherSettings batching;
};

class Service {
 public:
  Service(const Runner& runner, ModelInfo info, ServiceOptions options, Metrics* metrics);
  ~Service();
  void register_with(grpc::ServerBuilder& builder);
  // Start `threads` completion-queue threads (after BuildAndStart); each owns one queue filled in register_with.
  void start(grpc::Server* server);
  // Warm-up: `batches` forwards straight on the runner (before SERVING).
  void warm_up(int batches);
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
  int completion_queues = 1;  // set before register_with

  class Call;  // one call's state (service.cpp)

 private:
  friend class Call;
  friend class HttpServer;  // the REST front end (http.h): the same batchers, statistics, metrics and state
  const Runner& runner_;
  const ModelShape& shape_;
  ModelInfo info_;
  ServiceOptions options_;
  Metrics* metrics_;
  grpc::AsyncGenericService generic_;
  std::vector<std::unique_ptr<grpc::Service>> listed_;  // the services' names, for reflection
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> threads_;
  Statistics statistics_;  // before the batchers, which report to it
  std::unique_ptr<Batcher> lookups_, predictions_, both_;
  std::atomic<bool> ready_{false}, closing_{false}, serving_{true};
  std::atomic<int64_t> open_calls_{0};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> last_arrival_ns_{0};
  std::string v1_metadata_;  // ModelMetadata bytes, built once
  std::string oip_metadata_;  // ModelMetadataResponse bytes, built once
  std::string oip_config_;    // ModelConfigResponse bytes, built once
  std::string oip_config_json_;  // the same configuration in its JSON shape (REST)
  std::string oip_metadata_json_;  // the model metadata in its JSON shape (REST)
  std::string server_metadata_;

  void poll(grpc::ServerCompletionQueue* queue);
  void arm(grpc::ServerCompletionQueue* queue);
  int64_t arriving() const;
};

}  // namespace embserve::server
