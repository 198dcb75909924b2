// grpc.health.v1 on the server's completion queues (health.h).
#include "health.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/impl/codegen/rpc_service_method.h>
#include <grpcpp/support/byte_buffer.h>

#include <optional>
#include <vector>

namespace embserve::server {
namespace {
constexpr const char* kCheck = "/grpc.health.v1.Health/Check";
constexpr const char* kWatch = "/grpc.health.v1.Health/Watch";
// grpc.health.v1.HealthCheckResponse.ServingStatus
constexpr int kServing = 1, kNotServing = 2, kServiceUnknown = 3;
using Wire = google::protobuf::internal::WireFormatLite;

// HealthCheckRequest {string service = 1;} (proto3: the last value of a field wins, other fields are skipped, the
// string must be UTF-8); false when the bytes are no such message
bool parse_request(const grpc::ByteBuffer& buffer, std::string& service) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  service.clear();
  while (true) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return in.ConsumedEntireMessage() && in.BytesUntilLimit() == 0;
    if (tag == Wire::MakeTag(1, Wire::WIRETYPE_LENGTH_DELIMITED)) {
      uint32_t size = 0;
      if (!in.ReadVarint32(&size) || !in.ReadString(&service, static_cast<int>(size))) return false;
      if (!Wire::VerifyUtf8String(service.data(), static_cast<int>(service.size()), Wire::PARSE, "service"))
        return false;
      continue;
    }
    if (!Wire::SkipField(&in, tag)) return false;
  }
}

// HealthCheckResponse {ServingStatus status = 1;}
grpc::ByteBuffer response(int status) {
  const char bytes[2] = {0x08, static_cast<char>(status)};
  grpc::Slice slice(bytes, sizeof(bytes));
  return grpc::ByteBuffer(&slice, 1);
}
}  // namespace

Health::Health() {
  AddMethod(new grpc::internal::RpcServiceMethod(kCheck, grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
  AddMethod(new grpc::internal::RpcServiceMethod(kWatch, grpc::internal::RpcMethod::SERVER_STREAMING, nullptr));
  MarkMethodRaw(0);
  MarkMethodRaw(1);
}

int Health::status_of(const std::string& service) const {
  auto it = serving_.find(service);
  if (it == serving_.end()) return kServiceUnknown;
  return it->second ? kServing : kNotServing;
}

// ------------------------------------------------------------------------------------------------ Check
class Health::Check : public Tagged {
 public:
  Check(Health& health, grpc::ServerCompletionQueue* queue) : health_(health), queue_(queue), responder_(&context_) {
    health_.RequestAsyncUnary(0, &context_, &request_, &responder_, queue_, queue_, this);
  }

  void proceed(bool ok) override {
    if (!ok || answered_) {  // shutting down, or the answer went out
      delete this;
      return;
    }
    new Check(health_, queue_);  // the next call's slot
    answered_ = true;
    std::string service;
    if (!parse_request(request_, service))
      return responder_.FinishWithError(grpc::Status(grpc::INVALID_ARGUMENT, "could not parse request"), this);
    int status = 0;
    {
      std::lock_guard<std::mutex> lock(health_.mutex_);
      status = health_.status_of(service);
    }
    if (status == kServiceUnknown) return responder_.FinishWithError(grpc::Status(grpc::NOT_FOUND, ""), this);
    responder_.Finish(response(status), grpc::Status::OK, this);
  }

 private:
  Health& health_;
  grpc::ServerCompletionQueue* queue_;
  grpc::ServerContext context_;
  grpc::ByteBuffer request_;
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder_;
  bool answered_ = false;
};

// ------------------------------------------------------------------------------------------------ Watch
// The status now, then every change, until the caller goes (cancels, or its deadline passes). Two tags: this
// (the request, then each write) and done_ (the call ended); the object goes once both are through.
class Health::Watch : public Tagged {
 public:
  Watch(Health& health, grpc::ServerCompletionQueue* queue)
      : health_(health), queue_(queue), writer_(&context_), done_(*this) {
    context_.AsyncNotifyWhenDone(&done_);
    health_.RequestAsyncServerStreaming(1, &context_, &request_, &writer_, queue_, queue_, this);
  }

  void proceed(bool ok) override {
    std::unique_lock<std::mutex> lock(health_.mutex_);
    if (!started_) {
      started_ = true;
      if (!ok) {  // shutting down: no call came (done_ never fires for a call that never started)
        lock.unlock();
        delete this;
        return;
      }
      new Watch(health_, queue_);  // the next call's slot
      if (!parse_request(request_, service_)) {
        finishing_ = writing_ = true;
        writer_.Finish(grpc::Status(grpc::INVALID_ARGUMENT, "could not parse request"), this);
        return;
      }
      watched_ = health_.watchers_.emplace(service_, this);
      send(health_.status_of(service_));
      return;
    }
    writing_ = false;  // a write (or the refusal) completed
    if (!ok) failed_ = true;
    if (pending_ != 0 && !failed_ && !ended_) {
      const int next = pending_;
      pending_ = 0;
      send(next);
      return;
    }
    if (ended_) release(lock);
  }

  // a new status for this watcher (health_.mutex_ held)
  void send(int status) {
    if (failed_ || ended_ || finishing_) return;
    if (writing_) {
      pending_ = status;  // the latest status goes out once the write in flight is done
      return;
    }
    writing_ = true;
    writer_.Write(response(status), this);
  }

 private:
  class Done : public Tagged {
   public:
    explicit Done(Watch& watch) : watch_(watch) {}
    void proceed(bool) override { watch_.ended(); }

   private:
    Watch& watch_;
  };

  void ended() {
    std::unique_lock<std::mutex> lock(health_.mutex_);
    ended_ = true;
    if (watched_) {
      health_.watchers_.erase(*watched_);
      watched_.reset();
    }
    if (!writing_) release(lock);
  }

  void release(std::unique_lock<std::mutex>& lock) {
    lock.unlock();
    delete this;
  }

  Health& health_;
  grpc::ServerCompletionQueue* queue_;
  grpc::ServerContext context_;
  grpc::ByteBuffer request_;
  grpc::ServerAsyncWriter<grpc::ByteBuffer> writer_;
  Done done_;
  std::string service_;
  std::optional<std::multimap<std::string, Watch*>::iterator> watched_;
  bool started_ = false, writing_ = false, failed_ = false, ended_ = false, finishing_ = false;
  int pending_ = 0;
};

void Health::set_serving(const std::string& service, bool serving) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (shut_down_) return;
  serving_[service] = serving;
  const auto [first, last] = watchers_.equal_range(service);
  for (auto it = first; it != last; ++it) it->second->send(serving ? kServing : kNotServing);
}

void Health::shutdown() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (shut_down_) return;
  shut_down_ = true;
  for (auto& [service, serving] : serving_) serving = false;
  for (auto& [service, watch] : watchers_) watch->send(kNotServing);
}

void Health::arm(grpc::ServerCompletionQueue* queue) {
  new Check(*this, queue);
  new Watch(*this, queue);
}

}  // namespace embserve::server
