#include "server/metrics.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <sstream>

#include "CivetServer.h"
#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace moe {
namespace {

// Seconds, from 100 us (a small step's moed phases on a GPU host) to a minute (a large
// checkpoint or a CPU step of a big layer): measured latencies are in docs/PERFORMANCE.md.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,    0.5,    1.0,   2.5,    5.0,   10.0, 30.0,  60.0};
  return *buckets;
}

}  // namespace

// The registry, with the snapshot gauges refreshed first on every collection (scrape).
class Metrics::Refreshing : public prometheus::Collectable {
 public:
  explicit Refreshing(const Metrics* metrics) : metrics_(metrics) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    metrics_->RefreshGauges();
    return metrics_->registry_->Collect();
  }

 private:
  const Metrics* metrics_;
};

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  RegisterCallFamilies(*registry_);
  RegisterWorkerFamilies(*registry_);
  RegisterLayerFamilies(*registry_);
  RegisterBatchingFamilies(*registry_);
  RegisterGaugeFamilies(*registry_);
  collectable_ = std::make_shared<Refreshing>(this);
}

// Per public call: requests, refusals, latency, in flight, moed's step phases and payload.
void Metrics::RegisterCallFamilies(prometheus::Registry& r) {
  requests_ = &prometheus::BuildCounter()
                   .Name("moed_requests_total")
                   .Help("Public RPCs answered, by method and gRPC status code.")
                   .Register(r);
  denied_ = &prometheus::BuildCounter()
                 .Name("moed_denied_total")
                 .Help(
                     "Public RPCs refused by the token check (code 16 UNAUTHENTICATED, 7 "
                     "PERMISSION_DENIED), by the role they needed.")
                 .Register(r);
  request_seconds_ = &prometheus::BuildHistogram()
                          .Name("moed_request_duration_seconds")
                          .Help("Latency of public RPCs in moed (receipt to answer), by method.")
                          .Register(r);
  phase_seconds_ = &prometheus::BuildHistogram()
                        .Name("moed_step_phase_seconds")
                        .Help(
                            "Forward/Backward phases in moed by layer: queue (waiting for the "
                            "layer's turn), workers (their calls), gather.")
                        .Register(r);
  payload_bytes_ = &prometheus::BuildCounter()
                        .Name("moed_payload_bytes_total")
                        .Help(
                            "Tensor bytes of steps, by call and direction (in: x / d_out; "
                            "out: out / d_x), through messages or shared memory.")
                        .Register(r);
  inflight_ = &prometheus::BuildGauge()
                   .Name("moed_inflight_requests")
                   .Help("Public RPCs being served now (received, not yet answered), by method.")
                   .Register(r);
}

// Cross-caller batching of forwards (server/forward_batcher.h), per layer.
void Metrics::RegisterBatchingFamilies(prometheus::Registry& r) {
  merged_callers_ = &prometheus::BuildHistogram()
                         .Name("moed_merged_forward_callers")
                         .Help("Callers whose forwards shared one merged step, by layer.")
                         .Register(r);
  merged_tokens_ = &prometheus::BuildHistogram()
                        .Name("moed_merged_forward_tokens")
                        .Help("Tokens of a merged forward step (all its callers), by layer.")
                        .Register(r);
  batch_wait_seconds_ =
      &prometheus::BuildHistogram()
           .Name("moed_forward_batch_wait_seconds")
           .Help(
               "A batched forward's wait in the batcher, from arrival to the start of its "
               "merged step (the window and the layer's previous merged step), by layer.")
           .Register(r);
}

// Per worker rank: its part of each step.
void Metrics::RegisterWorkerFamilies(prometheus::Registry& r) {
  worker_phase_seconds_ = &prometheus::BuildHistogram()
                               .Name("moed_worker_phase_seconds")
                               .Help(
                                   "Each worker's part of a step, by rank, call and phase: "
                                   "call (moed's round trip to it), handler, decode, engine "
                                   "(the layer's step on the device, collectives included), "
                                   "encode.")
                               .Register(r);
  worker_payload_bytes_ = &prometheus::BuildCounter()
                               .Name("moed_worker_payload_bytes_total")
                               .Help("Tensor bytes of each worker's slices, by rank and direction.")
                               .Register(r);
  worker_all_to_all_seconds_ =
      &prometheus::BuildHistogram()
           .Name("moed_worker_all_to_all_seconds")
           .Help(
               "Each worker's all-to-all exchanges (token dispatch and combine) of a step, by "
               "rank and call: wall time of the calls on the worker (NCCL: the enqueue).")
           .Register(r);
  worker_all_to_all_bytes_ = &prometheus::BuildCounter()
                                  .Name("moed_worker_all_to_all_bytes_total")
                                  .Help(
                                      "Bytes each worker's all-to-all exchanges sent to and "
                                      "received from the other workers, by rank and direction.")
                                  .Register(r);
}

// Per layer and per cluster event: tokens, saved steps, re-formations, worker deaths.
void Metrics::RegisterLayerFamilies(prometheus::Registry& r) {
  tokens_ = &prometheus::BuildCounter()
                 .Name("moed_tokens_total")
                 .Help("Tokens processed by Forward, by layer.")
                 .Register(r);
  expert_tokens_ = &prometheus::BuildCounter()
                        .Name("moed_expert_tokens_total")
                        .Help("(token, slot) pairs routed to each expert, by layer.")
                        .Register(r);
  saved_steps_total_ = &prometheus::BuildCounter()
                            .Name("moed_saved_steps_total")
                            .Help(
                                "Saved steps (Forward with keep_for_backward) by event: "
                                "created, used (by a Backward), released, expired.")
                            .Register(r);
  skipped_steps_ = &prometheus::BuildCounter()
                        .Name("moed_optimizer_steps_skipped_total")
                        .Help(
                            "ApplyOptimizer steps skipped because the gradients held a NaN or "
                            "an Inf (skip_non_finite), by layer.")
                        .Register(r);
  reformations_ = &prometheus::BuildCounter()
                       .Name("moed_reformations_total")
                       .Help("Times the worker cluster was formed (a new generation).")
                       .Register(r)
                       .Add({});
  worker_deaths_ = &prometheus::BuildCounter()
                        .Name("moed_worker_deaths_total")
                        .Help(
                            "Workers lost (process exit, failed call and ping, missed "
                            "heartbeats); embedded workers are started again.")
                        .Register(r)
                        .Add({});
}

// Gauges, set from the snapshot at each scrape (RefreshGauges).
void Metrics::RegisterGaugeFamilies(prometheus::Registry& r) {
  serving_ = &prometheus::BuildGauge()
                  .Name("moed_serving")
                  .Help("1 when every worker is up and the service answers steps.")
                  .Register(r);
  generation_ = &prometheus::BuildGauge()
                     .Name("moed_generation")
                     .Help("The worker cluster's current generation.")
                     .Register(r);
  worker_alive_ = &prometheus::BuildGauge()
                       .Name("moed_worker_alive")
                       .Help("1 per live worker rank.")
                       .Register(r);
  worker_memory_ = &prometheus::BuildGauge()
                        .Name("moed_worker_memory_bytes")
                        .Help("Backend (device or host) memory of each worker.")
                        .Register(r);
  reserved_worker_memory_ =
      &prometheus::BuildGauge()
           .Name("moed_worker_memory_reserved_bytes")
           .Help(
               "Estimated memory per worker reserved by admitted steps still running "
               "(admission control, --worker_memory_bytes).")
           .Register(r);
  saved_steps_ = &prometheus::BuildGauge()
                      .Name("moed_saved_steps")
                      .Help("Steps kept for backward, by layer.")
                      .Register(r);
  saved_bytes_ = &prometheus::BuildGauge()
                      .Name("moed_saved_bytes")
                      .Help("Worker memory held by saved steps, by layer.")
                      .Register(r);
}

Metrics::~Metrics() = default;

void Metrics::CountDenied(const std::string& role, int grpc_code) {
  denied_->Add({{"role", role}, {"code", absl::StrCat(grpc_code)}}).Increment();
}

void Metrics::CountRequest(const std::string& method, int grpc_code, double seconds) {
  requests_->Add({{"method", method}, {"code", absl::StrCat(grpc_code)}}).Increment();
  request_seconds_->Add({{"method", method}}, LatencyBuckets()).Observe(seconds);
}

void Metrics::ObserveStep(const std::string& layer, const std::string& call, double queue_s,
                          double workers_s, double gather_s) {
  const std::pair<const char*, double> phases[] = {
      {"queue", queue_s}, {"workers", workers_s}, {"gather", gather_s}};
  absl::MutexLock lock(&mu_);
  for (const auto& [phase, seconds] : phases) {
    prometheus::Histogram& h =
        phase_seconds_->Add({{"layer", layer}, {"call", call}, {"phase", phase}}, LatencyBuckets());
    h.Observe(seconds);
    std::vector<prometheus::Histogram*>& mine = layer_histograms_[layer];
    if (std::find(mine.begin(), mine.end(), &h) == mine.end()) mine.push_back(&h);
  }
}

void Metrics::ObserveLayerHistogram(prometheus::Family<prometheus::Histogram>* family,
                                    const std::string& layer,
                                    const std::vector<double>& buckets, double value) {
  absl::MutexLock lock(&mu_);
  prometheus::Histogram& h = family->Add({{"layer", layer}}, buckets);
  h.Observe(value);
  std::vector<prometheus::Histogram*>& mine = layer_histograms_[layer];
  if (std::find(mine.begin(), mine.end(), &h) == mine.end()) mine.push_back(&h);
}

void Metrics::ObserveMergedForward(const std::string& layer, int callers, int64_t tokens) {
  static const auto* caller_buckets =
      new std::vector<double>{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  static const auto* token_buckets = new std::vector<double>{
      16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576};
  ObserveLayerHistogram(merged_callers_, layer, *caller_buckets, callers);
  ObserveLayerHistogram(merged_tokens_, layer, *token_buckets, static_cast<double>(tokens));
}

void Metrics::ObserveForwardQueueWait(const std::string& layer, double seconds) {
  // From 10 us (a window's scale) to a second (behind a long step).
  static const auto* buckets = new std::vector<double>{
      0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
      0.005,   0.01,     0.025,   0.05,   0.1,     0.25,   1.0};
  ObserveLayerHistogram(batch_wait_seconds_, layer, *buckets, seconds);
}

void Metrics::ObserveWorker(int rank, const std::string& call, double call_s,
                            const v1::WorkerStepTiming& timing) {
  const std::string r = absl::StrCat(rank);
  const std::pair<const char*, double> phases[] = {{"call", call_s},
                                                   {"handler", timing.handler_ms() / 1e3},
                                                   {"decode", timing.decode_ms() / 1e3},
                                                   {"engine", timing.engine_ms() / 1e3},
                                                   {"encode", timing.encode_ms() / 1e3}};
  for (const auto& [phase, seconds] : phases) {
    worker_phase_seconds_->Add({{"rank", r}, {"call", call}, {"phase", phase}}, LatencyBuckets())
        .Observe(seconds);
  }
  worker_all_to_all_seconds_->Add({{"rank", r}, {"call", call}}, LatencyBuckets())
      .Observe(timing.all_to_all_ms() / 1e3);
  worker_all_to_all_bytes_->Add({{"rank", r}, {"direction", "sent"}})
      .Increment(static_cast<double>(timing.all_to_all_bytes_sent()));
  worker_all_to_all_bytes_->Add({{"rank", r}, {"direction", "received"}})
      .Increment(static_cast<double>(timing.all_to_all_bytes_received()));
  worker_payload_bytes_->Add({{"rank", r}, {"direction", "in"}})
      .Increment(static_cast<double>(timing.bytes_in()));
  worker_payload_bytes_->Add({{"rank", r}, {"direction", "out"}})
      .Increment(static_cast<double>(timing.bytes_out()));
}

void Metrics::CountPayload(const std::string& call, int64_t bytes_in, int64_t bytes_out) {
  payload_bytes_->Add({{"call", call}, {"direction", "in"}})
      .Increment(static_cast<double>(bytes_in));
  payload_bytes_->Add({{"call", call}, {"direction", "out"}})
      .Increment(static_cast<double>(bytes_out));
}

void Metrics::CountTokens(const std::string& layer, int64_t tokens,
                          const std::vector<int64_t>& tokens_per_expert) {
  absl::MutexLock lock(&mu_);
  std::vector<prometheus::Counter*>& mine = layer_counters_[layer];
  auto remember = [&mine](prometheus::Counter& c) -> prometheus::Counter& {
    if (std::find(mine.begin(), mine.end(), &c) == mine.end()) mine.push_back(&c);
    return c;
  };
  remember(tokens_->Add({{"layer", layer}})).Increment(static_cast<double>(tokens));
  for (size_t e = 0; e < tokens_per_expert.size(); ++e) {
    remember(expert_tokens_->Add({{"layer", layer}, {"expert", absl::StrCat(e)}}))
        .Increment(static_cast<double>(tokens_per_expert[e]));
  }
}

void Metrics::CountSavedSteps(const std::string& event, int64_t n) {
  if (n > 0) saved_steps_total_->Add({{"event", event}}).Increment(static_cast<double>(n));
}

void Metrics::CountSkippedStep(const std::string& layer) {
  absl::MutexLock lock(&mu_);
  std::vector<prometheus::Counter*>& mine = layer_counters_[layer];
  prometheus::Counter& c = skipped_steps_->Add({{"layer", layer}});
  if (std::find(mine.begin(), mine.end(), &c) == mine.end()) mine.push_back(&c);
  c.Increment();
}

void Metrics::CountReformation() { reformations_->Increment(); }

void Metrics::DropLayer(const std::string& layer) {
  absl::MutexLock lock(&mu_);
  auto counters = layer_counters_.find(layer);
  if (counters != layer_counters_.end()) {
    for (prometheus::Counter* c : counters->second) {
      tokens_->Remove(c);  // a no-op in the family that does not hold c
      expert_tokens_->Remove(c);
      skipped_steps_->Remove(c);
    }
    layer_counters_.erase(counters);
  }
  auto histograms = layer_histograms_.find(layer);
  if (histograms != layer_histograms_.end()) {
    for (prometheus::Histogram* h : histograms->second) {
      for (auto* family : {phase_seconds_, merged_callers_, merged_tokens_, batch_wait_seconds_}) {
        family->Remove(h);  // a no-op in the families that do not hold h
      }
    }
    layer_histograms_.erase(histograms);
  }
}

prometheus::Gauge* Metrics::InflightGauge(const std::string& method) {
  return &inflight_->Add({{"method", method}});
}

InflightRequest::InflightRequest(Metrics* metrics, const std::string& method)
    : gauge_(metrics != nullptr ? metrics->InflightGauge(method) : nullptr) {
  if (gauge_ != nullptr) gauge_->Increment();
}

InflightRequest::~InflightRequest() {
  if (gauge_ != nullptr) gauge_->Decrement();
}

void Metrics::set_snapshot(std::function<MetricsSnapshot()> snapshot) {
  absl::MutexLock lock(&mu_);
  snapshot_ = std::move(snapshot);
}

void Metrics::RefreshGauges() const {
  std::function<MetricsSnapshot()> snapshot;
  {
    absl::MutexLock lock(&mu_);
    snapshot = snapshot_;
  }
  if (!snapshot) return;
  const MetricsSnapshot now = snapshot();  // outside mu_: it takes the service's locks
  absl::MutexLock lock(&mu_);
  std::map<std::pair<prometheus::Family<prometheus::Gauge>*, std::string>, prometheus::Gauge*> seen;
  auto set = [&](prometheus::Family<prometheus::Gauge>* family, const prometheus::Labels& labels,
                 const std::string& key, double value) {
    prometheus::Gauge& g = family->Add(labels);
    g.Set(value);
    seen[{family, key}] = &g;
  };
  if (now.worker_deaths > worker_deaths_seen_) {
    worker_deaths_->Increment(static_cast<double>(now.worker_deaths - worker_deaths_seen_));
    worker_deaths_seen_ = now.worker_deaths;
  }
  set(serving_, {}, "", now.serving ? 1 : 0);
  set(generation_, {}, "", static_cast<double>(now.generation));
  set(reserved_worker_memory_, {}, "", static_cast<double>(now.reserved_worker_bytes));
  for (const MetricsSnapshot::Worker& w : now.workers) {
    const std::string rank = absl::StrCat(w.rank);
    set(worker_alive_, {{"rank", rank}}, rank, w.alive ? 1 : 0);
    set(worker_memory_, {{"rank", rank}}, rank, static_cast<double>(w.memory_bytes));
  }
  for (const MetricsSnapshot::Layer& l : now.layers) {
    set(saved_steps_, {{"layer", l.name}}, l.name, static_cast<double>(l.saved_steps));
    set(saved_bytes_, {{"layer", l.name}}, l.name, static_cast<double>(l.saved_bytes));
  }
  // A worker rank or layer gone since the last scrape leaves the exposition.
  for (const auto& [key, gauge] : gauges_) {
    if (seen.find(key) == seen.end()) key.first->Remove(gauge);
  }
  gauges_ = std::move(seen);
}

std::string Metrics::Render() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, collectable_->Collect());
  return out.str();
}

absl::StatusOr<std::unique_ptr<MetricsExposer>> MetricsExposer::Start(const std::string& listen,
                                                                      const Metrics* metrics) {
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    // Two threads: one slow or stalled scraper does not block the others.
    static CivetCallbacks* callbacks = [] {
      auto* cb = new CivetCallbacks();
      cb->log_message = [](const struct mg_connection*, const char* message) {
        std::fprintf(stderr, "moed: metrics server: %s\n", message);
        return 1;
      };
      return cb;
    }();
    exposer = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/2, callbacks);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen=", listen, ": cannot listen: ", e.what()));
  }
  exposer->RegisterCollectable(metrics->collectable());
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("--metrics_listen=", listen, ": no listening port"));
  }
  return std::unique_ptr<MetricsExposer>(new MetricsExposer(std::move(exposer), ports[0]));
}

MetricsExposer::MetricsExposer(std::unique_ptr<prometheus::Exposer> exposer, int port)
    : exposer_(std::move(exposer)), port_(port) {}

MetricsExposer::~MetricsExposer() = default;

}  // namespace moe
