// grpc.health.v1 (Check, Watch) on the server's own completion queues, as grpc's default health service answers
// them. grpc's default service runs on its callback API, whose two polling threads ("nexting_thread") take turns
// at the server's sockets with the completion-queue thread: about two extra thread wake-ups and 30 us of CPU on
// every call, health or not. Served here, each call is answered on the completion-queue thread that received it.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/service_type.h>
#include <grpcpp/support/async_stream.h>
#include <grpcpp/support/async_unary_call.h>

#include <map>
#include <mutex>
#include <set>
#include <string>

namespace embserve::server {

// A completion-queue tag: the object whose operation completed (Service::poll calls proceed).
class Tagged {
 public:
  virtual ~Tagged() = default;
  virtual void proceed(bool ok) = 0;
};

class Health : public grpc::Service {
 public:
  Health();
  // grpc::HealthCheckServiceInterface's contract: a service's status (unknown services are NOT_FOUND to Check
  // and SERVICE_UNKNOWN to Watch); every watcher of it is told
  void set_serving(const std::string& service, bool serving);
  // Every service NOT_SERVING, and no change from now on (the drain)
  void shutdown();
  // After BuildAndStart: a slot for each method on `queue` (each answered call arms the next)
  void arm(grpc::ServerCompletionQueue* queue);

  class Check;
  class Watch;

 private:
  friend class Check;
  friend class Watch;
  int status_of(const std::string& service) const;  // HealthCheckResponse.ServingStatus; caller holds mutex_
  mutable std::mutex mutex_;
  std::map<std::string, bool> serving_;
  std::multimap<std::string, Watch*> watchers_;
  bool shut_down_ = false;
};

}  // namespace embserve::server
