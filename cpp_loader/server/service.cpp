// embserve.v1 and the Open Inference Protocol over gRPC: decode (in Python's words), batch, answer.
#include "service.h"

#include <grpcpp/support/byte_buffer.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/impl/codegen/rpc_service_method.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "embserve/v1/inference.pb.h"
#include "inference/open_inference_grpc.pb.h"
#include "internal_error.h"
#include "oip_codec.h"

namespace embserve::server {
namespace v1 = ::embserve::v1;
namespace oip = ::inference;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kDraining = "the server is shutting down; retry on another replica";
constexpr const char* kV1 = "/embserve.v1.InferenceService/";
constexpr const char* kOip = "/inference.GRPCInferenceService/";

// A refusal with its status code, message and embserve_rejected_total reason (server.pipeline.Failure).
struct Failure {
  grpc::StatusCode code;
  std::string message;
  const char* reason;
};

const char* code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::OK: return "OK";
    case grpc::CANCELLED: return "CANCELLED";
    case grpc::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::NOT_FOUND: return "NOT_FOUND";
    case grpc::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::UNIMPLEMENTED: return "UNIMPLEMENTED";
    default: return "INTERNAL";
  }
}

// ------------------------------------------------------------------ wire: a message's bytes fields written last
void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

// `head` (a serialized message without the field) then field `field` as bytes of `sizes[i]` each, left for the
// model to fill: returns the buffer and each field's data offset.
std::string with_bytes_fields(const std::string& head, int field, const std::vector<size_t>& sizes,
                              std::vector<size_t>& offsets) {
  std::string out;
  size_t total = head.size();
  for (size_t s : sizes) total += 16 + s;
  out.reserve(total);
  out = head;
  for (size_t s : sizes) {
    put_varint(out, (static_cast<uint64_t>(field) << 3) | 2);
    put_varint(out, s);
    offsets.push_back(out.size());
    out.resize(out.size() + s);
  }
  return out;
}

grpc::ByteBuffer buffer_of(std::string&& bytes) {
  auto* owned = new std::string(std::move(bytes));
  grpc::Slice slice(owned->data(), owned->size(), [](void* p) { delete static_cast<std::string*>(p); }, owned);
  return grpc::ByteBuffer(&slice, 1);
}

template <typename Message>
bool parse(const grpc::ByteBuffer& buffer, Message& message) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return false;
  if (slices.size() == 1) return message.ParseFromArray(slices[0].begin(), static_cast<int>(slices[0].size()));
  std::string joined;
  joined.reserve(buffer.Length());
  for (const auto& s : slices) joined.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return message.ParseFromString(joined);
}

template <typename Message>
Message parsed(const grpc::ByteBuffer& buffer, const char* name) {
  Message message;
  if (!parse(buffer, message))
    throw Failure{grpc::INVALID_ARGUMENT, std::string("request is not a valid ") + name, "undecodable"};
  return message;
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() != b.size();
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(1, b.size())]);
  return diff == 0;
}

// ------------------------------------------------------------------ OIP tensors: oip_codec.h (shared with REST)
constexpr const char* kDense = kOipDense;
constexpr const char* kEmbeddings = kOipEmbeddings;
constexpr const char* kScores = kOipScores;
using Input = OipInput;
int width_of(const std::string& datatype) { return oip_width(datatype); }

bool parameter_flag(const google::protobuf::Map<std::string, oip::InferParameter>& parameters, const char* name) {
  auto it = parameters.find(name);
  if (it == parameters.end()) return false;
  const auto& p = it->second;
  switch (p.parameter_choice_case()) {
    case oip::InferParameter::kBoolParam: return p.bool_param();
    case oip::InferParameter::kInt64Param: return p.int64_param() != 0;
    case oip::InferParameter::kDoubleParam: return p.double_param() != 0.0;
    case oip::InferParameter::kUint64Param: return p.uint64_param() != 0;
    case oip::InferParameter::kStringParam: {
      std::string s = p.string_param();
      size_t b = s.find_first_not_of(" \t\n\r\f\v"), e = s.find_last_not_of(" \t\n\r\f\v");
      s = b == std::string::npos ? "" : s.substr(b, e - b + 1);
      std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
      return s == "1" || s == "true" || s == "yes";
    }
    default: return false;
  }
}

grpc::StatusCode status_of(ModelSetError::Code code) {
  switch (code) {
    case ModelSetError::Code::NotFound: return grpc::NOT_FOUND;
    case ModelSetError::Code::FailedPrecondition: return grpc::FAILED_PRECONDITION;
    default: return grpc::INVALID_ARGUMENT;
  }
}

}  // namespace

// A service of `name` for reflection's list only: every real method is left to the generic service; the one
// method registered here has a name no client calls (grpc lists a service by its registered methods).
class ListedService : public grpc::Service {
 public:
  explicit ListedService(const std::string& name) : path_("/" + name + "/.listed-for-reflection") {
    AddMethod(new grpc::internal::RpcServiceMethod(path_.c_str(), grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
  }

 private:
  std::string path_;
};

// ============================================================================================ one call
class Service::Call : public Tagged {
 public:
  Call(Service& service, grpc::ServerCompletionQueue* queue) : service_(service), queue_(queue), stream_(&context_) {}

  void arm() {
    state_ = State::Requested;
    service_.generic_.RequestCall(&context_, &stream_, queue_, queue_, this);
  }

  void proceed(bool ok) override {
    switch (state_) {
      case State::Requested:
        if (!ok) {  // the server is shutting down
          delete this;
          return;
        }
        (new Call(service_, queue_))->arm();  // the next call's slot, before this one's work
        state_ = State::Reading;
        ++service_.open_calls_;
        stream_.Read(&request_, this);
        return;
      case State::Reading:
        if (!ok) {
          finish_status(grpc::Status(grpc::INVALID_ARGUMENT, "the call carried no request message"));
          return;
        }
        handle();
        return;
      case State::Finishing:
        --service_.open_calls_;
        delete this;
        return;
    }
  }

 private:
  enum class State { Requested, Reading, Finishing };
  Service& service_;
  grpc::ServerCompletionQueue* queue_;
  grpc::GenericServerContext context_;
  grpc::GenericServerAsyncReaderWriter stream_;
  grpc::ByteBuffer request_;
  State state_ = State::Requested;
  std::string method_;
  Clock::time_point started_;
  bool tracked_ = false;  // counted in flight (the drain waits for it)
  bool counted_ = false;  // a ModelInfer of the served model: the statistics extension counts its outcome
  Clock::time_point decoded_;  // when a ModelInfer was decoded and validated
  // a model call waiting for its batch: the decoded message (the request's views point into it), the request,
  // the response bytes the forward writes into
  v1::LookupRequest lookup_;
  v1::PredictRequest predict_;
  oip::ModelInferRequest infer_;
  Request request_model_;
  std::string reply_;
  embserve::server::Call batch_call_;
  std::shared_ptr<ServedVersion> model_;  // the version this call runs on (held: a swap frees it after the call)

  // ---------------------------------------------------------------- answers
  void finish_status(const grpc::Status& status) {
    state_ = State::Finishing;
    stream_.Finish(status, this);
  }

  void answer(std::string&& bytes) {
    record(grpc::OK, nullptr);
    state_ = State::Finishing;
    stream_.WriteAndFinish(buffer_of(std::move(bytes)), grpc::WriteOptions(), grpc::Status::OK, this);
  }

  void refuse(grpc::StatusCode code, const std::string& message, const char* reason) {
    record(code, reason);
    finish_status(grpc::Status(code, bounded(message)));
  }

  void record(grpc::StatusCode code, const char* reason) {
    if (reason != nullptr && *reason) service_.metrics_->rejected(reason);
    if (counted_) count_outcome(code);
    if (tracked_) {
      service_.metrics_->call(method_, code_name(code), std::chrono::duration<double>(Clock::now() - started_).count());
      tracked_ = false;
      --service_.in_flight_;
    }
  }

  // the statistics extension: a ModelInfer that found the model is a success or a failure of it
  // (OipCore.infer: from arrival to the answer; its input stage the decoding and the merge, its output stage the
  // split and the time until the answer was handed to grpc)
  void count_outcome(grpc::StatusCode code) {
    counted_ = false;
    const auto now = Clock::now();
    auto ns = [](Clock::duration d) { return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(); };
    const int64_t total = ns(now - started_);
    if (code != grpc::OK) return model_->statistics.request_failed(total);
    const StageTimes& t = batch_call_.timing;
    const int64_t input = ns(decoded_ - started_) + t.merge_ns, output = t.split_ns + ns(now - t.answered);
    model_->statistics.request_succeeded(request_model_.batch, total, t.queue_ns, input, t.forward_ns, output);
  }

  void internal(const std::exception& err) {
    const std::string id = log_internal(method_, err.what());
    refuse(grpc::INTERNAL, "internal error (request id " + id + "); see the server log", "internal");
  }

  // ---------------------------------------------------------------- dispatch
  void handle() {
    started_ = Clock::now();
    method_ = context_.method();
    const bool v1_method = method_.rfind(kV1, 0) == 0, oip_method = method_.rfind(kOip, 0) == 0;
    const std::string name = method_.substr(method_.rfind('/') + 1);
    try {
      if (!service_.options_.auth_token.empty() && !(oip_method && (name == "ServerLive" || name == "ServerReady")))
        check_token();
      if (v1_method) {
        if (name == "Lookup") return begin_tracked(name), lookup();
        if (name == "Predict") return begin_tracked(name), predict();
        if (name == "GetModelMetadata") return v1_metadata();
      } else if (oip_method) {
        if (name == "ServerLive") return oip_simple<oip::ServerLiveResponse>([](auto& r) { r.set_live(true); });
        if (name == "ServerReady")
          return oip_simple<oip::ServerReadyResponse>([this](auto& r) { r.set_ready(service_.oip_ready()); });
        if (name == "ServerMetadata") return answer(std::string(service_.server_metadata_));
        begin_tracked(name);
        if (name == "ModelInfer") return model_infer();
        if (name == "ModelReady") return model_ready();
        if (name == "ModelMetadata") return model_metadata();
        if (name == "ModelConfig") return model_config();
        if (name == "ModelStatistics") return model_statistics();
        if (name == "RepositoryIndex") return repository_index();
        if (name == "RepositoryModelLoad") return repository_load(false);
        if (name == "RepositoryModelUnload") return repository_load(true);
      }
      refuse(grpc::UNIMPLEMENTED, "unknown method " + clip(method_), "");
    } catch (const Failure& failure) {
      refuse(failure.code, failure.message, failure.reason);
    } catch (const ModelSetError& err) {
      refuse(status_of(err.code), err.what(), err.reason);
    } catch (const BadRequest& err) {
      refuse(grpc::INVALID_ARGUMENT, err.what(), "invalid");
    } catch (const std::exception& err) {
      internal(err);
    }
  }

  void begin_tracked(const std::string& name) {
    method_ = name;
    tracked_ = true;
    ++service_.in_flight_;
    service_.last_arrival_ns_ = Clock::now().time_since_epoch().count();
  }

  void check_token() {
    const auto& metadata = context_.client_metadata();
    const std::string expected = "Bearer " + service_.options_.auth_token;
    for (auto it = metadata.find("authorization"); it != metadata.end() && it->first == "authorization"; ++it)
      if (constant_time_equal(std::string(it->second.data(), it->second.size()), expected)) return;
    throw Failure{grpc::UNAUTHENTICATED, "missing or wrong bearer token (metadata 'authorization')", ""};
  }

  template <typename Response, typename Fill>
  void oip_simple(Fill fill) {
    Response response;
    fill(response);
    answer(response.SerializeAsString());
  }

  // warm-up and drain (server.pipeline.Pipeline.accept)
  void accept() {
    if (!service_.ready_) throw Failure{grpc::UNAVAILABLE, "the server is warming up; retry shortly", "warming_up"};
    if (service_.closing_) throw Failure{grpc::UNAVAILABLE, kDraining, "draining"};
  }

  // ModelSet.find: the version the call runs on, held until the call is answered (a swap never waits for it)
  void find(const std::string& name, const std::string& version) {
    model_ = service_.models().find(name, version);
  }

  // v1 requests naming a model (InferenceServicer._target); none: the default model's newest version
  void target(const std::string& name, const std::string& version) {
    model_ = service_.models().v1_target(name, version);
  }

  void check_deadline() {
    if (context_.deadline() < std::chrono::system_clock::now())
      throw Failure{grpc::DEADLINE_EXCEEDED, "the deadline passed before the request was batched", "deadline"};
  }

  void submit(Batcher& batcher) {
    if (request_model_.batch > service_.options_.max_batch_size)
      throw BadRequest(too_large(request_model_.batch, service_.options_.max_batch_size));
    batch_call_.request = &request_model_;
    if (!batcher.submit(&batch_call_))
      throw Failure{grpc::RESOURCE_EXHAUSTED,
                    "the request queue is full (" + std::to_string(service_.options_.batching.max_queue) +
                        " requests); retry later",
                    "queue_full"};
  }

  void on_done(Outcome outcome, const std::string& message) {
    if (outcome == Outcome::Ok) return answer(std::move(reply_));
    if (outcome == Outcome::BadRequest) return refuse(grpc::INVALID_ARGUMENT, message, "invalid");
    internal(std::runtime_error(message));
  }

  // ---------------------------------------------------------------- embserve.v1
  void decode_sparse(const v1::SparseFeatures& sparse) {
    const ModelShape& shape = model_->shape();
    Request& r = request_model_;
    if (sparse.form_case() == v1::SparseFeatures::kPacked) {
      const v1::PackedFeatures& packed = sparse.packed();
      if (packed.id_type() != v1::ID_TYPE_INT64 && packed.id_type() != v1::ID_TYPE_INT32)
        throw BadRequest("unknown id_type " + std::to_string(packed.id_type()) +
                         "; use ID_TYPE_INT64 or ID_TYPE_INT32");
      const int width = packed.id_type() == v1::ID_TYPE_INT64 ? 8 : 4;
      std::vector<std::string> keys(packed.feature_order().begin(), packed.feature_order().end());
      if (keys.empty()) throw BadRequest("packed.feature_order is empty; list the features of `lengths` in order");
      auto check = [](const std::string& data, int w, const char* what, const char* dtype) {
        if (data.size() % static_cast<size_t>(w))
          throw BadRequest(std::string(what) + " has " + std::to_string(data.size()) + " bytes, not a multiple of " +
                           std::to_string(w) + " (" + dtype + " values)");
      };
      check(packed.ids(), width, "packed.ids", width == 8 ? "torch.int64" : "torch.int32");
      check(packed.lengths(), 4, "packed.lengths", "torch.int32");
      if (!packed.weights().empty()) check(packed.weights(), 4, "packed.weights", "torch.float32");
      Array ids{r.aligned(packed.ids().data(), static_cast<int64_t>(packed.ids().size()), width), width,
                static_cast<int64_t>(packed.ids().size()) / width};
      Array lengths{r.aligned(packed.lengths().data(), static_cast<int64_t>(packed.lengths().size()), 4), 4,
                    static_cast<int64_t>(packed.lengths().size()) / 4};
      const float* weights = nullptr;
      const int64_t num_weights = static_cast<int64_t>(packed.weights().size()) / 4;
      if (!packed.weights().empty())
        weights = static_cast<const float*>(
            r.aligned(packed.weights().data(), static_cast<int64_t>(packed.weights().size()), 4));
      validate_concatenated(keys, ids, lengths, weights, num_weights, shape, r);
    } else if (sparse.form_case() == v1::SparseFeatures::kTyped) {
      const auto& typed = sparse.typed().features();
      if (typed.empty()) throw BadRequest("typed.features is empty");
      std::vector<std::string> keys;
      for (const auto& [key, bags] : typed) keys.push_back(key);
      for (const auto& key : keys)
        if (typed.at(key).lengths_size() != typed.at(keys[0]).lengths_size())
          throw BadRequest(bags_differ(clip(key), typed.at(key).lengths_size(), clip(keys[0]),
                                       typed.at(keys[0]).lengths_size()));
      bool weighted = false;
      for (const auto& key : keys) weighted = weighted || typed.at(key).weights_size() > 0;
      for (const auto& key : keys) {
        const auto& bags = typed.at(key);
        int64_t total = 0, shortest = 0;
        for (int32_t length : bags.lengths()) {
          total += length;
          shortest = std::min<int64_t>(shortest, length);
        }
        if (total != bags.ids_size() && shortest >= 0)
          throw BadRequest("feature '" + clip(key) + "': lengths sum to " + std::to_string(total) + " but there are " +
                           std::to_string(bags.ids_size()) + " ids; lengths must add up to the number of ids");
        if (weighted && bags.weights_size() != bags.ids_size())
          throw BadRequest("feature '" + clip(key) + "': weights has " + std::to_string(bags.weights_size()) +
                           " entries but there are " + std::to_string(bags.ids_size()) +
                           " ids; give one weight per id (or weight none)");
      }
      r.storage.emplace_back();
      r.storage.emplace_back();
      r.storage.emplace_back();
      auto& id_bytes = r.storage[r.storage.size() - 3];
      auto& length_bytes = r.storage[r.storage.size() - 2];
      auto& weight_bytes = r.storage[r.storage.size() - 1];
      for (const auto& key : keys) {
        const auto& bags = typed.at(key);
        auto add = [](std::vector<char>& out, const void* data, size_t size) {
          out.insert(out.end(), static_cast<const char*>(data), static_cast<const char*>(data) + size);
        };
        add(id_bytes, bags.ids().data(), sizeof(int64_t) * static_cast<size_t>(bags.ids_size()));
        add(length_bytes, bags.lengths().data(), sizeof(int32_t) * static_cast<size_t>(bags.lengths_size()));
        if (weighted) add(weight_bytes, bags.weights().data(), sizeof(float) * static_cast<size_t>(bags.weights_size()));
      }
      Array ids{id_bytes.data(), 8, static_cast<int64_t>(id_bytes.size() / 8)};
      Array lengths{length_bytes.data(), 4, static_cast<int64_t>(length_bytes.size() / 4)};
      const float* weights = weighted ? reinterpret_cast<const float*>(weight_bytes.data()) : nullptr;
      validate_concatenated(keys, ids, lengths, weights, static_cast<int64_t>(weight_bytes.size() / 4), shape, r);
    } else {
      throw BadRequest("request carries no sparse features (set sparse.typed or sparse.packed)");
    }
  }

  void lookup() {
    lookup_ = parsed<v1::LookupRequest>(request_, "LookupRequest");
    accept();
    const int output_type = lookup_.output_type();
    if (output_type != v1::OUTPUT_TYPE_FP32 && output_type != v1::OUTPUT_TYPE_FP16)
      throw BadRequest("unknown output_type " + std::to_string(output_type));
    target(lookup_.model_name(), lookup_.model_version());
    const auto decoding = Clock::now();
    decode_sparse(lookup_.sparse());
    service_.metrics_->stage("decode", std::chrono::duration<double>(Clock::now() - decoding).count());
    check_deadline();
    const ModelShape& shape = model_->shape();
    const bool fp16 = output_type == v1::OUTPUT_TYPE_FP16;
    v1::LookupResponse head;
    head.set_batch_size(static_cast<int32_t>(request_model_.batch));
    head.set_dim(static_cast<int32_t>(shape.output_dim));
    head.set_output_type(static_cast<v1::OutputType>(output_type));
    for (const auto& f : shape.features) {
      auto* column = head.add_columns();
      column->set_feature(f.name);
      column->set_start(static_cast<int32_t>(f.column_start));
      column->set_end(static_cast<int32_t>(f.column_end));
    }
    head.set_model_version(model_->info.version);
    std::vector<size_t> offsets;
    const size_t size = static_cast<size_t>(request_model_.batch * shape.output_dim) * (fp16 ? 2 : 4);
    if (request_model_.batch * shape.output_dim > 0) {
      reply_ = with_bytes_fields(head.SerializeAsString(), v1::LookupResponse::kEmbeddingsFieldNumber, {size}, offsets);
      batch_call_.embeddings = reply_.data() + offsets[0];
    } else {
      reply_ = head.SerializeAsString();
    }
    batch_call_.embeddings_fp16 = fp16;
    batch_call_.done = [this](Outcome outcome, const std::string& message) { on_done(outcome, message); };
    submit(*model_->lookups);
  }

  void predict() {
    predict_ = parsed<v1::PredictRequest>(request_, "PredictRequest");
    accept();
    target(predict_.model_name(), predict_.model_version());
    if (!model_->predictions)
      throw Failure{grpc::FAILED_PRECONDITION, "this model has no dense part; call Lookup", "no_dense_part"};
    const auto decoding = Clock::now();
    decode_sparse(predict_.sparse());
    const std::string& dense = predict_.dense_features();
    if (dense.size() % 4)
      throw BadRequest("dense_features has " + std::to_string(dense.size()) +
                       " bytes, not a multiple of 4 (torch.float32 values)");
    const int64_t num_dense = model_->shape().num_dense_features;
    if (static_cast<int64_t>(dense.size() / 4) != request_model_.batch * num_dense)
      throw BadRequest("dense_features holds " + std::to_string(dense.size() / 4) + " floats; expected batch " +
                       std::to_string(request_model_.batch) + " x " + std::to_string(num_dense) + " features");
    request_model_.dense =
        static_cast<const float*>(request_model_.aligned(dense.data(), static_cast<int64_t>(dense.size()), 4));
    service_.metrics_->stage("decode", std::chrono::duration<double>(Clock::now() - decoding).count());
    check_deadline();
    v1::PredictResponse head;
    head.set_batch_size(static_cast<int32_t>(request_model_.batch));
    head.set_model_version(model_->info.version);
    std::vector<size_t> offsets;
    if (request_model_.batch > 0) {
      reply_ = with_bytes_fields(head.SerializeAsString(), v1::PredictResponse::kScoresFieldNumber,
                                 {static_cast<size_t>(request_model_.batch) * 4}, offsets);
      batch_call_.scores = reinterpret_cast<float*>(reply_.data() + offsets[0]);
    } else {
      reply_ = head.SerializeAsString();
    }
    batch_call_.done = [this](Outcome outcome, const std::string& message) { on_done(outcome, message); };
    submit(*model_->predictions);
  }

  void v1_metadata() {
    if (service_.closing_) {
      service_.metrics_->call("GetModelMetadata", "UNAVAILABLE", 0.0);
      throw Failure{grpc::UNAVAILABLE, kDraining, ""};
    }
    v1::GetModelMetadataRequest request;
    if (parse(request_, request) && (!request.model_name().empty() || !request.model_version().empty())) {
      begin_tracked("GetModelMetadata");
      target(request.model_name(), request.model_version());
      return answer(std::string(model_->v1_metadata));
    }
    target("", "");
    service_.metrics_->call("GetModelMetadata", "OK", 0.0);
    answer(std::string(model_->v1_metadata));
  }

  // ---------------------------------------------------------------- the Open Inference Protocol
  void model_ready() {
    auto request = parsed<oip::ModelReadyRequest>(request_, "ModelReadyRequest");
    const bool ready = service_.oip_ready() && service_.models().ready(request.name(), request.version());
    oip::ModelReadyResponse response;
    response.set_ready(ready);
    answer(response.SerializeAsString());
  }

  void model_metadata() {
    auto request = parsed<oip::ModelMetadataRequest>(request_, "ModelMetadataRequest");
    find(request.name(), request.version());
    // OipCore.model_metadata: the model's loaded versions, and the ones that failed to load with why
    oip::ModelMetadataResponse response;
    response.ParseFromString(model_->oip_metadata);
    for (const auto& v : service_.models().versions(request.name())) response.add_versions(v);
    const auto failures = service_.models().failures(request.name());
    if (!failures.empty()) (*response.mutable_properties())["failed_versions"] = python_json(failures);
    answer(response.SerializeAsString());
  }

  // the model-configuration extension: Triton's ModelConfig of the one model (ServedModel.config)
  void model_config() {
    auto request = parsed<oip::ModelConfigRequest>(request_, "ModelConfigRequest");
    find(request.name(), request.version());
    answer(std::string(model_->oip_config));
  }

  // the statistics extension (OipCore.model_statistics): every loaded version of every model (no name), of one
  // model (no version), or one version; an unknown model or version is NOT_FOUND in the metadata's words
  void model_statistics() {
    auto request = parsed<oip::ModelStatisticsRequest>(request_, "ModelStatisticsRequest");
    std::vector<std::shared_ptr<ServedVersion>> models;
    if (request.name().empty()) {
      models = service_.models().served();
    } else if (!request.version().empty()) {
      models.push_back(service_.models().find(request.name(), request.version()));
    } else {
      for (const auto& v : service_.models().versions(request.name()))
        models.push_back(service_.models().find(request.name(), v));
    }
    auto put = [](oip::StatisticDuration* to, const Duration& from) {
      to->set_count(from.count);
      to->set_ns(from.ns);
    };
    oip::ModelStatisticsResponse response;
    for (const auto& model : models) {
      const StatisticsSnapshot s = model->statistics.snapshot();
      auto* m = response.add_model_stats();
      m->set_name(model->name);
      m->set_version(model->version);
      m->set_last_inference(s.last_inference_ms);
      m->set_inference_count(s.inference_count);
      m->set_execution_count(s.execution_count);
      auto* stages = m->mutable_inference_stats();
      put(stages->mutable_success(), s.success);
      put(stages->mutable_fail(), s.fail);
      put(stages->mutable_queue(), s.queue);
      put(stages->mutable_compute_input(), s.compute_input);
      put(stages->mutable_compute_infer(), s.compute_infer);
      put(stages->mutable_compute_output(), s.compute_output);
      for (const auto& [examples, durations] : s.batches) {
        auto* batch = m->add_batch_stats();
        batch->set_batch_size(static_cast<uint64_t>(examples));
        put(batch->mutable_compute_input(), durations.compute_input);
        put(batch->mutable_compute_infer(), durations.compute_infer);
        put(batch->mutable_compute_output(), durations.compute_output);
      }
    }
    answer(response.SerializeAsString());
  }

  // the repository extension: the index (ModelSet.index), and load/unload on a thread of their own (a load
  // verifies and warms a version: seconds a completion-queue thread must not wait), answered from there
  void repository_index() {
    auto request = parsed<oip::RepositoryIndexRequest>(request_, "RepositoryIndexRequest");
    oip::RepositoryIndexResponse response;
    for (const auto& entry : service_.models().index(request.ready())) {
      auto* model = response.add_models();
      model->set_name(entry.name);
      model->set_version(entry.version);
      model->set_state(entry.state);
      model->set_reason(entry.reason);
    }
    answer(response.SerializeAsString());
  }

  void repository_load(bool unload) {
    std::string name;
    if (unload) {
      name = parsed<oip::RepositoryModelUnloadRequest>(request_, "RepositoryModelUnloadRequest").model_name();
    } else {
      name = parsed<oip::RepositoryModelLoadRequest>(request_, "RepositoryModelLoadRequest").model_name();
    }
    std::thread([this, name, unload] {
      try {
        if (unload) {
          service_.models().unload(name);
          answer(oip::RepositoryModelUnloadResponse().SerializeAsString());
        } else {
          service_.models().load(name);
          answer(oip::RepositoryModelLoadResponse().SerializeAsString());
        }
      } catch (const ModelSetError& err) {
        refuse(status_of(err.code), err.what(), err.reason);
      } catch (const std::exception& err) {
        internal(err);
      }
    }).detach();
  }

  // grpc_inputs: every input's name, datatype, shape and data (raw bytes or typed contents), sizes checked
  std::vector<Input> oip_inputs() {
    const auto& raw = infer_.raw_input_contents();
    if (raw.size() && raw.size() != infer_.inputs_size())
      throw BadRequest("raw_input_contents has " + std::to_string(raw.size()) + " entries for " +
                       std::to_string(infer_.inputs_size()) +
                       " inputs; send every input raw (one entry each, in order) or every input as typed contents");
    std::vector<Input> inputs;
    for (int i = 0; i < infer_.inputs_size(); ++i) {
      const auto& tensor = infer_.inputs(i);
      Input input{tensor.name(), tensor.datatype(), {tensor.shape().begin(), tensor.shape().end()}, {}};
      __int128 exact = 0;
      if (raw.size()) {
        const int64_t count = checked_count(input.name, input.datatype, input.shape, exact);
        const int width = width_of(input.datatype);
        const std::string& bytes = raw.Get(i);
        if (static_cast<__int128>(bytes.size()) != exact * width)
          throw BadRequest("input " + py_repr(input.name) + ": " + std::to_string(bytes.size()) +
                           " bytes of raw data for shape " + shape_text(input.shape) + " " + input.datatype +
                           " (expected " + wide(exact * width) + " bytes)");
        input.data = {request_model_.aligned(bytes.data(), static_cast<int64_t>(bytes.size()), width), width, count};
      } else {
        const auto& contents = tensor.contents();
        const void* data = nullptr;
        int64_t given = 0;
        int width = 0;
        if (input.datatype == "INT64") {
          data = contents.int64_contents().data(), given = contents.int64_contents_size(), width = 8;
        } else if (input.datatype == "INT32") {
          data = contents.int_contents().data(), given = contents.int_contents_size(), width = 4;
        } else if (input.datatype == "FP32") {
          data = contents.fp32_contents().data(), given = contents.fp32_contents_size(), width = 4;
        } else if (input.datatype == "FP16") {
          throw BadRequest("input " + py_repr(input.name) + ": FP16 data travel raw (raw_input_contents)");
        } else {
          throw refused_datatype(input.name, input.datatype);
        }
        checked_count(input.name, input.datatype, input.shape, exact);
        if (static_cast<__int128>(given) != exact)
          throw BadRequest("input " + py_repr(input.name) + ": " + std::to_string(given) + " elements for shape " +
                           shape_text(input.shape) + " (expected " + wide(exact) + ")");
        input.data = {data, width, given};
      }
      inputs.push_back(std::move(input));
    }
    return inputs;
  }

  // decode_inputs + _checked_batch: per-feature inputs to one validated request in model order
  void decode_oip(const std::vector<Input>& inputs) { decode_oip_inputs(inputs, model_->shape(), request_model_); }

  void model_infer() {
    infer_ = parsed<oip::ModelInferRequest>(request_, "ModelInferRequest");
    accept();
    const bool fp16 = parameter_flag(infer_.parameters(), "output_fp16");
    find(infer_.model_name(), infer_.model_version());
    counted_ = true;
    const auto decoding = Clock::now();
    decode_oip(oip_inputs());
    const ModelShape& shape = model_->shape();
    std::vector<OipOutput> requested;
    for (const auto& o : infer_.outputs())
      requested.push_back({o.name(), fp16 || parameter_flag(o.parameters(), "output_fp16")});
    const OipOutputs chosen =
        choose_oip_outputs(requested, shape.num_dense_features > 0, request_model_.dense != nullptr, fp16);
    std::vector<std::pair<std::string, bool>> outputs;  // name, fp16
    for (const auto& o : chosen.outputs) outputs.emplace_back(o.name, o.fp16);
    const bool wants_scores = chosen.scores, wants_embeddings = chosen.embeddings;
    service_.metrics_->stage("decode", std::chrono::duration<double>(Clock::now() - decoding).count());
    if (request_model_.batch > service_.options_.max_batch_size)
      throw BadRequest(too_large(request_model_.batch, service_.options_.max_batch_size));
    decoded_ = Clock::now();
    // the response: outputs described, then their raw contents, written by the forward
    oip::ModelInferResponse head;
    head.set_model_name(model_->name);
    head.set_model_version(model_->version);
    head.set_id(infer_.id());
    std::vector<size_t> sizes;
    const int64_t batch = request_model_.batch;
    for (const auto& [name, half] : outputs) {
      auto* out = head.add_outputs();
      out->set_name(name);
      if (name == kEmbeddings) {
        out->set_datatype(half ? "FP16" : "FP32");
        out->add_shape(batch);
        out->add_shape(shape.output_dim);
        sizes.push_back(static_cast<size_t>(batch * shape.output_dim) * (half ? 2 : 4));
      } else {
        out->set_datatype("FP32");
        out->add_shape(batch);
        sizes.push_back(static_cast<size_t>(batch) * 4);
      }
    }
    std::vector<size_t> offsets;
    reply_ = with_bytes_fields(head.SerializeAsString(), oip::ModelInferResponse::kRawOutputContentsFieldNumber, sizes,
                               offsets);
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].first == kEmbeddings) {
        batch_call_.embeddings = reply_.data() + offsets[i];
        batch_call_.embeddings_fp16 = outputs[i].second;
      } else {
        batch_call_.scores = reinterpret_cast<float*>(reply_.data() + offsets[i]);
      }
    }
    batch_call_.done = [this](Outcome outcome, const std::string& message) { on_done(outcome, message); };
    if (!wants_scores) {
      request_model_.dense = nullptr;
      submit(*model_->lookups);
    } else {
      submit(wants_embeddings ? *model_->both : *model_->predictions);
    }
  }
};

// ============================================================================================ the service
ModelInfo read_model_info(const std::string& artifact_dir, const std::string& model_name) {
  std::ifstream file(artifact_dir + "/manifest.json");
  nlohmann::json manifest = nlohmann::json::parse(file);  // the loader checked it against the schema already
  ModelInfo info;
  std::string dir = artifact_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  info.name = model_name.empty() ? dir.substr(dir.rfind('/') == std::string::npos ? 0 : dir.rfind('/') + 1) : model_name;
  info.sha256 = manifest["files"][manifest["model_file"].get<std::string>()]["sha256"].get<std::string>();
  info.version = info.sha256.substr(0, 16);
  info.format_version = manifest["format_version"].get<int>();
  for (const auto& t : manifest["tables"])
    info.tables.push_back({t["name"], t["num_embeddings"], t["embedding_dim"], t["data_type"], t["pooling"],
                           t["feature_names"].get<std::vector<std::string>>()});
  info.devices = manifest["devices"].get<std::vector<std::string>>();
  info.world_size = manifest["sharding"]["world_size"].get<int>();
  return info;
}

Service::Service(ServiceOptions options, Metrics* metrics) : options_(std::move(options)), metrics_(metrics) {
  oip::ServerMetadataResponse s;
  s.set_name("embserve");
  s.set_version(EMBSERVE_VERSION);
  s.add_extensions("binary_tensor_data");
  s.add_extensions("model_repository");
  s.add_extensions("model_configuration");
  s.add_extensions("statistics");
  server_metadata_ = s.SerializeAsString();
}

std::shared_ptr<ServedVersion> Service::build_version(std::unique_ptr<Runner> runner, ModelInfo info,
                                                      const std::string& name, const std::string& version) const {
  std::shared_ptr<ServedVersion> served(new ServedVersion(), release_in_background);
  served->name = name;
  served->version = version;
  served->runner = std::move(runner);
  const ModelShape& shape = served->runner->shape();
  // the batchers report to this version's statistics (held by pointer: the version outlives its batchers)
  Statistics* statistics = &served->statistics;
  std::function<int64_t()> arriving_calls = [this] { return arriving(); };
  ExecutionObserver executions = [statistics](int64_t examples, const StageTimes& stages) {
    statistics->execution(examples, stages.merge_ns, stages.forward_ns, stages.split_ns);
  };
  auto batcher = [&](Forward forward) {
    return std::make_unique<Batcher>(*served->runner, forward, shape, options_.batching, metrics_, arriving_calls,
                                     executions);
  };
  served->lookups = batcher(Forward::Lookup);
  if (shape.num_dense_features > 0) {
    served->predictions = batcher(Forward::Predict);
    served->both = batcher(Forward::Both);
  }
  // embserve.v1 metadata (InferenceServicer._build_metadata)
  v1::ModelMetadata meta;
  meta.set_model_version(info.version);
  meta.set_format_version(info.format_version);
  for (const auto& t : info.tables) {
    auto* table = meta.add_tables();
    table->set_name(t.name);
    table->set_num_embeddings(t.num_embeddings);
    table->set_embedding_dim(static_cast<int32_t>(t.embedding_dim));
    table->set_data_type(t.data_type);
    table->set_pooling(t.pooling);
    for (const auto& f : t.feature_names) table->add_feature_names(f);
  }
  for (const auto& f : shape.features) {
    meta.add_feature_order(f.name);
    auto* column = meta.add_columns();
    column->set_feature(f.name);
    column->set_start(static_cast<int32_t>(f.column_start));
    column->set_end(static_cast<int32_t>(f.column_end));
  }
  meta.set_output_dim(static_cast<int32_t>(shape.output_dim));
  meta.set_has_dense(shape.num_dense_features > 0);
  meta.set_num_dense_features(static_cast<int32_t>(shape.num_dense_features));
  for (const auto& d : info.devices) meta.add_devices(d);
  meta.set_world_size(info.world_size);
  meta.set_embserve_version(EMBSERVE_VERSION);
  meta.set_max_batch_size(static_cast<int32_t>(options_.max_batch_size));
  served->v1_metadata = meta.SerializeAsString();
  // OIP model metadata (ServedModel.metadata)
  oip::ModelMetadataResponse m;
  m.set_name(name);
  m.set_platform("embserve_torchscript");
  auto add = [](auto* list, const std::string& name, const char* datatype, std::vector<int64_t> dims) {
    auto* t = list->Add();
    t->set_name(name);
    t->set_datatype(datatype);
    for (int64_t d : dims) t->add_shape(d);
  };
  for (const auto& f : shape.features) {
    add(m.mutable_inputs(), f.name + "__values", "INT64", {-1});
    add(m.mutable_inputs(), f.name + "__lengths", "INT32", {-1});
    add(m.mutable_inputs(), f.name + "__offsets", "INT32", {-1});
    add(m.mutable_inputs(), f.name + "__weights", "FP32", {-1});
  }
  add(m.mutable_outputs(), kEmbeddings, "FP32", {-1, shape.output_dim});
  const bool has_dense = shape.num_dense_features > 0;
  if (has_dense) {
    add(m.mutable_inputs(), kDense, "FP32", {-1, shape.num_dense_features});
    add(m.mutable_outputs(), kScores, "FP32", {-1});
  }
  auto& props = *m.mutable_properties();
  std::string order, columns = "{";
  for (size_t i = 0; i < shape.features.size(); ++i) {
    const auto& f = shape.features[i];
    order += (i ? "," : "") + f.name;
    columns += (i ? "," : "") + nlohmann::json(f.name).dump() + ":[" + std::to_string(f.column_start) + "," +
               std::to_string(f.column_end) + "]";
    props["columns." + f.name] = std::to_string(f.column_start) + ":" + std::to_string(f.column_end);
    props["rows." + f.name] = std::to_string(f.num_embeddings);
  }
  props["feature_order"] = order;
  props["columns"] = columns + "}";
  props["output_dim"] = std::to_string(shape.output_dim);
  props["num_dense_features"] = std::to_string(has_dense ? shape.num_dense_features : 0);
  props["max_batch_size"] = std::to_string(options_.max_batch_size);
  props["model_sha256"] = info.sha256;
  props["embserve_version"] = EMBSERVE_VERSION;
  served->oip_metadata = m.SerializeAsString();  // without versions: the answer lists the loaded ones
  // the same metadata in its JSON shape (REST: ServedModel.metadata), also without versions
  nlohmann::json metadata_json = {{"name", m.name()}, {"platform", m.platform()},
                                  {"inputs", nlohmann::json::array()}, {"outputs", nlohmann::json::array()},
                                  {"properties", nlohmann::json::object()}};
  for (const auto* list : {&m.inputs(), &m.outputs()})
    for (const auto& t : *list)
      metadata_json[list == &m.inputs() ? "inputs" : "outputs"].push_back(
          {{"name", t.name()}, {"datatype", t.datatype()}, {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}});
  for (const auto& [key, value] : m.properties()) metadata_json["properties"][key] = value;
  served->oip_metadata_json = metadata_json.dump();
  // Triton's model configuration, in its JSON shape and parsed as protobuf's JSON (ServedModel.config): the
  // metadata's tensors with their whole shapes, max_batch_size 0 (the inputs are ragged: no batch dimension in
  // front), the server's largest request as a parameter, the batcher as dynamic batching
  nlohmann::json config = {{"name", name}, {"platform", "embserve_torchscript"}, {"backend", "embserve"},
                           {"max_batch_size", 0}, {"input", nlohmann::json::array()},
                           {"output", nlohmann::json::array()}, {"parameters", nlohmann::json::object()}};
  auto tensor = [](const oip::ModelMetadataResponse::TensorMetadata& t) {
    return nlohmann::json{{"name", t.name()}, {"data_type", "TYPE_" + t.datatype()},
                          {"dims", std::vector<int64_t>(t.shape().begin(), t.shape().end())}};
  };
  for (const auto& t : m.inputs()) {
    auto entry = tensor(t);
    const std::string& n = t.name();
    entry["optional"] = !(n.size() > 8 && n.compare(n.size() - 8, 8, "__values") == 0);
    config["input"].push_back(entry);
  }
  for (const auto& t : m.outputs()) config["output"].push_back(tensor(t));
  for (const auto& [key, value] : m.properties()) config["parameters"][key] = {{"string_value", value}};
  if (std::min(options_.batching.max_batch_size, options_.batching.max_merge_examples) > 1)
    config["dynamic_batching"] = {
        {"max_queue_delay_microseconds", static_cast<int64_t>(std::llround(options_.batching.max_delay_s * 1e6))}};
  oip::ModelConfigResponse config_response;
  google::protobuf::util::JsonParseOptions json_options;
  if (!google::protobuf::util::JsonStringToMessage(config.dump(), config_response.mutable_config(), json_options).ok())
    throw std::runtime_error("the model configuration does not parse as inference.ModelConfig");
  served->oip_config = config_response.SerializeAsString();
  served->oip_config_json = config.dump();
  served->info = std::move(info);
  return served;
}

Service::~Service() { stop(); }

void Service::register_with(grpc::ServerBuilder& builder) {
  builder.RegisterAsyncGenericService(&generic_);
  builder.RegisterService(&health_);
  for (const char* name : {"embserve.v1.InferenceService", "inference.GRPCInferenceService"}) {
    listed_.push_back(std::make_unique<ListedService>(name));
    builder.RegisterService(listed_.back().get());
  }
  for (int i = 0; i < std::max(1, completion_queues); ++i) queues_.push_back(builder.AddCompletionQueue());
}

void Service::poll(grpc::ServerCompletionQueue* queue) {
  void* tag;
  bool ok;
  while (queue->Next(&tag, &ok)) static_cast<Tagged*>(tag)->proceed(ok);
}

void Service::start(grpc::Server* server) {
  (void)server;
  for (auto& queue : queues_) {
    // a few slots per queue: calls arriving together each find one armed
    for (int i = 0; i < 4; ++i) (new Call(*this, queue.get()))->arm();
    health_.arm(queue.get());
    threads_.emplace_back([this, q = queue.get()] { poll(q); });
  }
}

void Service::stop() {
  for (auto& queue : queues_) queue->Shutdown();
  for (auto& t : threads_) t.join();
  threads_.clear();
  // the slots still armed come back with ok=false and delete themselves inside poll; drain what is left
  for (auto& queue : queues_) {
    void* tag;
    bool ok;
    while (queue->Next(&tag, &ok)) static_cast<Tagged*>(tag)->proceed(ok);
  }
  queues_.clear();
}

void Service::begin_closing() {
  closing_ = true;
  serving_ = false;
  if (ModelSet* models = models_.load()) models->flush();
}

double Service::seconds_since_last_call() const {
  const auto last = Clock::time_point(Clock::duration(last_arrival_ns_.load()));
  return std::chrono::duration<double>(Clock::now() - last).count();
}

int64_t Service::arriving() const {
  const ModelSet* models = models_;
  return in_flight_ - (models != nullptr ? models->held() : 0);
}

double Service::queue_depth() const {
  const ModelSet* models = models_;
  return models != nullptr ? models->depth() : 0.0;
}

void warm_up(const ServedVersion& model, int batches, int64_t max_batch_size) {
  // a small batch of the model's first ids, straight on the runner (no queue, no delay); every embedding must be
  // finite (server/repository.py _check_warm_answer), else the version is refused
  const Runner& runner = *model.runner;
  const ModelShape& shape = runner.shape();
  const int64_t batch = std::min<int64_t>(64, max_batch_size);
  const size_t num_features = shape.features.size();
  for (int seed = 0; seed < std::max(1, batches); ++seed) {
    std::vector<int64_t> ids;
    std::vector<int32_t> lengths;
    for (size_t f = 0; f < num_features; ++f)
      for (int64_t b = 0; b < batch; ++b) {
        lengths.push_back(8);
        for (int i = 0; i < 8; ++i) ids.push_back((b * 8 + i + seed) % shape.features[f].num_embeddings);
      }
    SparseBatch sparse;
    sparse.ids = ids.data();
    sparse.num_ids = static_cast<int64_t>(ids.size());
    sparse.lengths = lengths.data();
    sparse.num_lengths = static_cast<int64_t>(lengths.size());
    sparse.batch = batch;
    std::vector<float> pooled(static_cast<size_t>(batch * shape.output_dim));
    runner.run(Forward::Lookup, sparse, {{0, batch, pooled.data(), false, nullptr}});
    for (float value : pooled)
      if (!std::isfinite(value))
        throw RunnerError("model " + py_repr(model.name) + " version " + model.version +
                              ": its warm-up lookup answered non-finite embeddings; re-export the version",
                          "LoadError");
    if (shape.num_dense_features > 0) {
      std::vector<float> dense(static_cast<size_t>(batch * shape.num_dense_features), 0.0f), scores(batch);
      sparse.dense = dense.data();
      runner.run(Forward::Predict, sparse, {{0, batch, nullptr, false, scores.data()}});
    }
  }
}

}  // namespace embserve::server
