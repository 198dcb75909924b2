// Prometheus metrics of embserve-server, named as the Python server's (server/metrics.py), served on /metrics by
// prometheus-cpp's exposer.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "batcher.h"

namespace prometheus {
class Exposer;
class Registry;
class Counter;
class Histogram;
class Gauge;
template <typename T>
class Family;
}  // namespace prometheus

namespace embserve::server {

class Metrics : public BatchObserver {
 public:
  // queue_depth() and in_flight() are read at scrape time
  Metrics(std::function<double()> queue_depth, std::function<double()> in_flight);
  ~Metrics() override;

  void call(const std::string& method, const char* code, double seconds);  // one answered call
  void rejected(const char* reason);                                        // embserve_rejected_total
  void batch(int requests, int64_t examples) override;
  void stage(const char* stage, double seconds) override;
  // Serve /metrics on host:port (0: a free one); returns the port. Throws std::runtime_error naming a port in use.
  int serve(const std::string& host, int port);

 private:
  class Scrape;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Scrape> scrape_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* latency_;
  prometheus::Family<prometheus::Counter>* rejected_;
  prometheus::Histogram* batch_examples_;
  prometheus::Histogram* batch_requests_;
  prometheus::Family<prometheus::Histogram>* stages_;
  std::mutex mutex_;  // the labelled children, looked up once
  std::map<std::pair<std::string, std::string>, prometheus::Counter*> calls_;
  std::map<std::string, prometheus::Histogram*> latencies_;
  std::map<std::string, prometheus::Counter*> reasons_;
  std::map<std::string, prometheus::Histogram*> stage_children_;
};

}  // namespace embserve::server
