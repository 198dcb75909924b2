#include "metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <stdexcept>

namespace embserve::server {
namespace {
const prometheus::Histogram::BucketBoundaries kLatency = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
                                                          0.1,    0.2,   0.5,   1.0,   2.0,  5.0};
const prometheus::Histogram::BucketBoundaries kStages = {1e-5,  2e-5,  5e-5,  1e-4, 2e-4, 5e-4, 0.001,
                                                         0.002, 0.005, 0.01, 0.02, 0.05, 0.1,  0.5};
const prometheus::Histogram::BucketBoundaries kBatch = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
}  // namespace

// The registry, with the gauges read at scrape time (a value set when a call finished would miss the waiting ones).
class Metrics::Scrape : public prometheus::Collectable {
 public:
  Scrape(std::shared_ptr<prometheus::Registry> registry, prometheus::Gauge& depth, prometheus::Gauge& in_flight,
         std::function<double()> read_depth, std::function<double()> read_in_flight)
      : registry_(std::move(registry)),
        depth_(depth),
        in_flight_(in_flight),
        read_depth_(std::move(read_depth)),
        read_in_flight_(std::move(read_in_flight)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    depth_.Set(read_depth_());
    in_flight_.Set(read_in_flight_());
    return registry_->Collect();
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge& depth_;
  prometheus::Gauge& in_flight_;
  std::function<double()> read_depth_, read_in_flight_;
};

Metrics::Metrics(std::function<double()> queue_depth, std::function<double()> in_flight)
    : registry_(std::make_shared<prometheus::Registry>()) {
  using namespace prometheus;
  requests_ = &BuildCounter().Name("embserve_requests_total").Help("RPCs handled, by method and status code").Register(*registry_);
  latency_ = &BuildHistogram().Name("embserve_request_latency_seconds").Help("RPC latency in the server, by method").Register(*registry_);
  batch_examples_ = &BuildHistogram().Name("embserve_batch_examples").Help("examples per batched forward").Register(*registry_).Add({}, kBatch);
  batch_requests_ = &BuildHistogram().Name("embserve_batch_requests").Help("requests merged per batched forward").Register(*registry_).Add({}, kBatch);
  rejected_ = &BuildCounter()
                   .Name("embserve_rejected_total")
                   .Help("requests answered with an error, by reason (invalid, undecodable, queue_full, warming_up, "
                         "internal, ...)")
                   .Register(*registry_);
  stages_ = &BuildHistogram()
                 .Name("embserve_stage_seconds")
                 .Help("time in each stage of the request pipeline: decode (+validate), queue (wait for a batch), "
                       "merge, lookup (the forward), split (per batch), encode (per request)")
                 .Register(*registry_);
  for (const char* stage : {"decode", "queue", "merge", "lookup", "split", "encode"})
    stage_children_[stage] = &stages_->Add({{"stage", stage}}, kStages);
  auto& depth = BuildGauge().Name("embserve_queue_depth").Help("requests waiting to be batched").Register(*registry_).Add({});
  auto& flight = BuildGauge().Name("embserve_in_flight").Help("gRPC model calls accepted and not yet answered").Register(*registry_).Add({});
  scrape_ = std::make_shared<Scrape>(registry_, depth, flight, std::move(queue_depth), std::move(in_flight));
}

Metrics::~Metrics() = default;

void Metrics::call(const std::string& method, const char* code, double seconds) {
  prometheus::Counter* counter;
  prometheus::Histogram* latency;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto key = std::make_pair(method, std::string(code));
    auto it = calls_.find(key);
    if (it == calls_.end()) it = calls_.emplace(key, &requests_->Add({{"method", method}, {"code", code}})).first;
    counter = it->second;
    auto lt = latencies_.find(method);
    if (lt == latencies_.end()) lt = latencies_.emplace(method, &latency_->Add({{"method", method}}, kLatency)).first;
    latency = lt->second;
  }
  counter->Increment();
  latency->Observe(seconds);
}

void Metrics::rejected(const char* reason) {
  prometheus::Counter* counter;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = reasons_.find(reason);
    if (it == reasons_.end()) it = reasons_.emplace(reason, &rejected_->Add({{"reason", reason}})).first;
    counter = it->second;
  }
  counter->Increment();
}

void Metrics::batch(int requests, int64_t examples) {
  batch_requests_->Observe(requests);
  batch_examples_->Observe(static_cast<double>(examples));
}

void Metrics::stage(const char* stage, double seconds) {
  auto it = stage_children_.find(stage);  // filled once in the constructor: read without the lock
  if (it != stage_children_.end()) it->second->Observe(seconds);
}

int Metrics::serve(const std::string& host, int port) {
  const std::string address = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
                              std::to_string(port);
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(address, 1);
  } catch (const std::exception& err) {
    throw std::runtime_error(err.what());
  }
  exposer_->RegisterCollectable(scrape_);
  auto ports = exposer_->GetListeningPorts();
  return ports.empty() ? port : ports.front();
}

}  // namespace embserve::server
