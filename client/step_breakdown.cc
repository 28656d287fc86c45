#include "client/step_breakdown.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe {
namespace client {
namespace {

// Adds b's phases into a (worker lists element by element).
void AddTimes(const StepTimes& b, StepTimes* a) {
  a->encode_ms += b.encode_ms;
  a->call_ms += b.call_ms;
  a->decode_ms += b.decode_ms;
  v1::StepTiming& s = a->server;
  s.set_moed_ms(s.moed_ms() + b.server.moed_ms());
  s.set_queue_ms(s.queue_ms() + b.server.queue_ms());
  s.set_fanout_ms(s.fanout_ms() + b.server.fanout_ms());
  s.set_gather_ms(s.gather_ms() + b.server.gather_ms());
  for (int r = 0; r < b.server.workers_size(); ++r) {
    if (s.workers_size() <= r) s.add_workers();
    v1::WorkerStepTiming* w = s.mutable_workers(r);
    const v1::WorkerStepTiming& v = b.server.workers(r);
    w->set_call_ms(w->call_ms() + v.call_ms());
    w->set_handler_ms(w->handler_ms() + v.handler_ms());
    w->set_decode_ms(w->decode_ms() + v.decode_ms());
    w->set_engine_ms(w->engine_ms() + v.engine_ms());
    w->set_encode_ms(w->encode_ms() + v.encode_ms());
    w->set_bytes_in(w->bytes_in() + v.bytes_in());
    w->set_bytes_out(w->bytes_out() + v.bytes_out());
  }
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

void StepBreakdown::Add(double latency_ms, const std::vector<const StepTimes*>& calls) {
  Sample sample;
  sample.latency_ms = latency_ms;
  for (const StepTimes* call : calls) AddTimes(*call, &sample.sum);
  for (const v1::WorkerStepTiming& w : sample.sum.server.workers()) {
    sample.engine_ms = std::max(sample.engine_ms, w.engine_ms());
    sample.payload_bytes += static_cast<double>(w.bytes_in() + w.bytes_out());
  }
  samples_.push_back(std::move(sample));
}

Json StepBreakdown::ToJson() const {
  auto median = [&](const std::function<double(const Sample&)>& field) {
    std::vector<double> v;
    for (const Sample& s : samples_) v.push_back(field(s));
    return Round3(Median(v));
  };
  const double latency = median([](const Sample& s) { return s.latency_ms; });
  const double engine = median([](const Sample& s) { return s.engine_ms; });
  const double bytes = median([](const Sample& s) { return s.payload_bytes; });
  const double transport_ms = latency - engine;
  Json workers = Json::array();
  const int ranks = samples_.empty() ? 0 : samples_[0].sum.server.workers_size();
  for (int r = 0; r < ranks; ++r) {
    auto w = [r](const Sample& s) -> const v1::WorkerStepTiming& {
      return s.sum.server.workers(std::min(r, s.sum.server.workers_size() - 1));
    };
    Json worker;
    worker["call_ms"] = median([&](const Sample& s) { return w(s).call_ms(); });
    worker["handler_ms"] = median([&](const Sample& s) { return w(s).handler_ms(); });
    worker["decode_ms"] = median([&](const Sample& s) { return w(s).decode_ms(); });
    worker["engine_ms"] = median([&](const Sample& s) { return w(s).engine_ms(); });
    worker["encode_ms"] = median([&](const Sample& s) { return w(s).encode_ms(); });
    workers.push_back(std::move(worker));
  }
  Json out;
  out["latency_ms"] = latency;
  out["client"]["encode_ms"] = median([](const Sample& s) { return s.sum.encode_ms; });
  out["client"]["call_ms"] = median([](const Sample& s) { return s.sum.call_ms; });
  out["client"]["decode_ms"] = median([](const Sample& s) { return s.sum.decode_ms; });
  out["moed"]["moed_ms"] = median([](const Sample& s) { return s.sum.server.moed_ms(); });
  out["moed"]["queue_ms"] = median([](const Sample& s) { return s.sum.server.queue_ms(); });
  out["moed"]["fanout_ms"] = median([](const Sample& s) { return s.sum.server.fanout_ms(); });
  out["moed"]["gather_ms"] = median([](const Sample& s) { return s.sum.server.gather_ms(); });
  out["wire_and_reply_ms"] =
      median([](const Sample& s) { return s.sum.call_ms - s.sum.server.moed_ms(); });
  out["workers"] = std::move(workers);
  out["engine_ms"] = engine;
  out["service_over_engine"] = Round3(engine > 0 ? latency / engine : 0.0);
  out["payload_bytes"] = static_cast<int64_t>(bytes);
  out["payload_gb_per_s"] = Round3(transport_ms > 0 ? bytes / transport_ms / 1e6 : 0.0);
  return out;
}

}  // namespace client
}  // namespace moe
