// Prometheus text-format metrics of the front end, and a tiny HTTP/1.0 responder that serves
// them on GET (any path) from its own thread.
//
//   Metrics metrics;
//   metrics.CountRequest("Forward", grpc::StatusCode::OK, 0.004);
//   ASSIGN_OR_RETURN(auto http, MetricsHttpServer::Start(9090, [&] { return metrics.Render(); }));
//
// Exposed: moed_requests_total{method,code}, moed_request_seconds_{sum,count}{method},
// moed_tokens_total{layer}, moed_expert_tokens_total{layer,expert}, plus whatever the
// `extra` callback appends (worker and layer gauges).
#ifndef MOED_SERVER_METRICS_H_
#define MOED_SERVER_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace moe {

class Metrics {
 public:
  void CountRequest(const std::string& method, int grpc_code, double seconds);
  void CountTokens(const std::string& layer, int64_t tokens,
                   const std::vector<int64_t>& tokens_per_expert);
  // Drops every series of `layer` (DeleteLayer): a name created again starts from zero.
  void DropLayer(const std::string& layer);
  void set_extra(std::function<std::string()> extra) { extra_ = std::move(extra); }
  std::string Render() const;

 private:
  struct Latency {
    double sum = 0;
    int64_t count = 0;
  };
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Latency> latency_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> tokens_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<int64_t>> expert_tokens_ ABSL_GUARDED_BY(mu_);
  std::function<std::string()> extra_;
};

class MetricsHttpServer {
 public:
  // Listens on 0.0.0.0:port (0 picks a free port, see port()).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      int port, std::function<std::string()> render);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer(int fd, int port, std::function<std::string()> render);
  void Serve();

  int fd_;
  int port_;
  std::function<std::string()> render_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace moe

#endif  // MOED_SERVER_METRICS_H_
