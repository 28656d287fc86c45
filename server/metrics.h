// The front end's Prometheus metrics, kept in a prometheus-cpp registry and served by
// prometheus-cpp's pull exposer (civetweb) on --metrics_listen. docs/METRICS.md is the
// reference of every series (name, type, labels, meaning).
//
//   Metrics metrics;
//   metrics.CountRequest("Forward", grpc::StatusCode::OK, 0.004);
//   metrics.set_snapshot([&] { return MetricsSnapshot{...}; });   // gauges, read per scrape
//   ASSIGN_OR_RETURN(auto exposer, MetricsExposer::Start("127.0.0.1:9090", &metrics));
//
// Counters and histograms are updated by the service as calls finish; gauges (serving, workers,
// saved steps) come from the snapshot callback, called once per scrape. Everything here is
// thread-safe (prometheus-cpp's metrics are atomic; the series maps are guarded by mu_).
#ifndef MOED_SERVER_METRICS_H_
#define MOED_SERVER_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/moe.pb.h"

namespace prometheus {
class Collectable;
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace moe {

// The values of the gauges at one scrape.
struct MetricsSnapshot {
  bool serving = false;
  int64_t generation = 0;
  int64_t worker_deaths = 0;  // since moed started (a counter: only grows)
  // Admission control: bytes per worker reserved by admitted calls still running.
  int64_t reserved_worker_bytes = 0;
  struct Worker {
    int rank = 0;
    bool alive = false;
    int64_t memory_bytes = 0;
  };
  std::vector<Worker> workers;
  struct Layer {
    std::string name;
    int64_t saved_steps = 0;
    int64_t saved_bytes = 0;
  };
  std::vector<Layer> layers;
};

class Metrics {
 public:
  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // A public RPC answered: moed_requests_total{method,code} and
  // moed_request_duration_seconds{method}.
  void CountRequest(const std::string& method, int grpc_code, double seconds);
  // A public call refused by the role check (UNAUTHENTICATED / PERMISSION_DENIED), by the
  // role it needed: moed_denied_total{role,code}.
  void CountDenied(const std::string& role, int grpc_code);
  // A step's moed phases (seconds): moed_step_phase_seconds{layer,call,phase} for phase =
  // queue (waiting for the layer's turn), workers (the fan-out: the workers' calls), gather.
  void ObserveStep(const std::string& layer, const std::string& call, double queue_s,
                   double workers_s, double gather_s);
  // One worker's part of a step, from its StepTiming (proto/moe.proto WorkerStepTiming):
  // moed_worker_phase_seconds{rank,call,phase} for phase = call (moed's round trip), handler,
  // decode, engine, encode; moed_worker_payload_bytes_total{rank,direction};
  // moed_worker_all_to_all_seconds{rank,call} and
  // moed_worker_all_to_all_bytes_total{rank,direction=sent|received}.
  void ObserveWorker(int rank, const std::string& call, double call_s,
                     const v1::WorkerStepTiming& timing);
  // Tensor bytes of a step: moed_payload_bytes_total{call,direction="in"|"out"}.
  void CountPayload(const std::string& call, int64_t bytes_in, int64_t bytes_out);
  void CountTokens(const std::string& layer, int64_t tokens,
                   const std::vector<int64_t>& tokens_per_expert);
  // A forward step merged from several callers' (server/forward_batcher.h):
  // moed_merged_forward_callers{layer} and moed_merged_forward_tokens{layer}.
  void ObserveMergedForward(const std::string& layer, int callers, int64_t tokens);
  // One caller's wait in the forward batcher (arrival to its merged step's start):
  // moed_forward_batch_wait_seconds{layer}.
  void ObserveForwardQueueWait(const std::string& layer, double seconds);
  // Saved steps by what happened to them: moed_saved_steps_total{event=created|used|
  // released|expired}.
  void CountSavedSteps(const std::string& event, int64_t n);
  // An ApplyOptimizer with skip_non_finite skipped its step (the gradients held a NaN or an
  // Inf): moed_optimizer_steps_skipped_total{layer}.
  void CountSkippedStep(const std::string& layer);
  // The cluster re-formed (a new generation): moed_reformations_total.
  void CountReformation();
  // Drops every series of `layer` (DeleteLayer): a name created again starts from zero.
  void DropLayer(const std::string& layer);

  // moed_inflight_requests{method}: public calls whose body runs now (InflightRequest).
  prometheus::Gauge* InflightGauge(const std::string& method);

  void set_snapshot(std::function<MetricsSnapshot()> snapshot);

  // The text exposition format of everything above (what a scrape returns).
  std::string Render() const;
  // What the exposer serves: the registry, with the gauges refreshed per collection.
  std::shared_ptr<prometheus::Collectable> collectable() const { return collectable_; }

 private:
  class Refreshing;
  void RefreshGauges() const;
  // The constructor's parts: each registers its families in `r`.
  void RegisterCallFamilies(prometheus::Registry& r);
  void RegisterWorkerFamilies(prometheus::Registry& r);
  void RegisterLayerFamilies(prometheus::Registry& r);
  void RegisterBatchingFamilies(prometheus::Registry& r);
  // Observes `value` in `family`'s series of `layer` (kept for DropLayer).
  void ObserveLayerHistogram(prometheus::Family<prometheus::Histogram>* family,
                             const std::string& layer,
                             const std::vector<double>& buckets, double value);
  void RegisterGaugeFamilies(prometheus::Registry& r);

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> collectable_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* denied_;
  prometheus::Family<prometheus::Histogram>* request_seconds_;
  prometheus::Family<prometheus::Histogram>* phase_seconds_;
  prometheus::Family<prometheus::Counter>* payload_bytes_;
  prometheus::Family<prometheus::Histogram>* worker_phase_seconds_;
  prometheus::Family<prometheus::Counter>* worker_payload_bytes_;
  prometheus::Family<prometheus::Histogram>* worker_all_to_all_seconds_;
  prometheus::Family<prometheus::Counter>* worker_all_to_all_bytes_;
  prometheus::Family<prometheus::Gauge>* inflight_;
  prometheus::Family<prometheus::Counter>* tokens_;
  prometheus::Family<prometheus::Counter>* expert_tokens_;
  prometheus::Family<prometheus::Counter>* saved_steps_total_;
  prometheus::Family<prometheus::Counter>* skipped_steps_;
  prometheus::Family<prometheus::Histogram>* merged_callers_;
  prometheus::Family<prometheus::Histogram>* merged_tokens_;
  prometheus::Family<prometheus::Histogram>* batch_wait_seconds_;
  prometheus::Counter* reformations_;
  prometheus::Counter* worker_deaths_;
  mutable int64_t worker_deaths_seen_ ABSL_GUARDED_BY(mu_) = 0;
  prometheus::Family<prometheus::Gauge>* serving_;
  prometheus::Family<prometheus::Gauge>* generation_;
  prometheus::Family<prometheus::Gauge>* worker_alive_;
  prometheus::Family<prometheus::Gauge>* worker_memory_;
  prometheus::Family<prometheus::Gauge>* reserved_worker_memory_;
  prometheus::Family<prometheus::Gauge>* saved_steps_;
  prometheus::Family<prometheus::Gauge>* saved_bytes_;

  mutable absl::Mutex mu_;
  std::function<MetricsSnapshot()> snapshot_ ABSL_GUARDED_BY(mu_);
  // Per-layer series, so DropLayer can remove them.
  std::map<std::string, std::vector<prometheus::Counter*>> layer_counters_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<prometheus::Histogram*>> layer_histograms_ ABSL_GUARDED_BY(mu_);
  // Gauges set at the last refresh (removed when their worker or layer is gone).
  mutable std::map<std::pair<prometheus::Family<prometheus::Gauge>*, std::string>,
                   prometheus::Gauge*>
      gauges_ ABSL_GUARDED_BY(mu_);
};

// One public call in moed_inflight_requests{method}: +1 while it lives. `metrics` may be null.
//
//   const InflightRequest inflight(metrics_, "Forward");
class InflightRequest {
 public:
  InflightRequest(Metrics* metrics, const std::string& method);
  ~InflightRequest();
  InflightRequest(const InflightRequest&) = delete;
  InflightRequest& operator=(const InflightRequest&) = delete;

 private:
  prometheus::Gauge* const gauge_;
};

// prometheus-cpp's HTTP exposer serving a Metrics on /metrics.
class MetricsExposer {
 public:
  // listen: "host:port" (an explicit port: civetweb cannot pick a free one). UNAVAILABLE when it
  // cannot bind (port in use: an error, never shared).
  static absl::StatusOr<std::unique_ptr<MetricsExposer>> Start(const std::string& listen,
                                                               const Metrics* metrics);
  ~MetricsExposer();
  int port() const { return port_; }

 private:
  MetricsExposer(std::unique_ptr<prometheus::Exposer> exposer, int port);
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_;
};

}  // namespace moe

#endif  // MOED_SERVER_METRICS_H_
