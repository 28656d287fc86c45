// moectl bench --callers=N: N concurrent inference callers of --tokens tokens each on one
// layer, first with every forward `unbatched` (a worker step per call, as before moed merged
// callers), then batched (moed's cross-caller batching, server/README.md), in the same run:
// tokens/s over all callers, each caller's latency p50 / p99, their ratios, and whether every
// batched answer is bit-identical to the same caller's unbatched one.
#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/json_output.h"
#include "client/layer_flags.h"
#include "client/moectl.h"
#include "client/tensor_util.h"
#include "engine/status_macros.h"

ABSL_DECLARE_FLAG(int64_t, steps);
ABSL_DECLARE_FLAG(int64_t, warmup);

namespace moe {
namespace client {
namespace cli {
namespace {

struct CallerRun {
  Tensor x;
  Tensor last_out;  // the answer of its last forward in this mode
  std::vector<int64_t> last_counts;
  std::vector<double> latency_ms;
  absl::Status status;
};

// Every caller's warmup + steps forwards at once; `unbatched` on each. The wall time runs from
// the first timed forward of any caller to the last one's end.
absl::StatusOr<Json> RunCallers(MoeClient& c, const std::string& layer, bool unbatched,
                                int64_t warmup, int64_t steps, std::vector<CallerRun>* callers) {
  absl::Mutex mu;
  absl::Time first = absl::InfiniteFuture(), last = absl::InfinitePast();
  std::vector<std::thread> threads;
  for (CallerRun& caller : *callers) {
    caller.latency_ms.clear();
    threads.emplace_back([&] {
      CallOptions call;
      call.unbatched = unbatched;
      for (int64_t i = 0; i < warmup + steps; ++i) {
        const absl::Time t0 = absl::Now();
        if (i == warmup) {
          absl::MutexLock lock(&mu);
          first = std::min(first, t0);
        }
        absl::StatusOr<ForwardOutput> fwd = c.Forward(layer, caller.x, false, call);
        if (!fwd.ok()) {
          caller.status = fwd.status();
          return;
        }
        const absl::Time t1 = absl::Now();
        caller.last_out = std::move(fwd->out);
        caller.last_counts = std::move(fwd->tokens_per_expert);
        if (i >= warmup) caller.latency_ms.push_back(absl::ToDoubleMilliseconds(t1 - t0));
        if (i + 1 == warmup + steps) {
          absl::MutexLock lock(&mu);
          last = std::max(last, t1);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<double> all;
  int64_t tokens = 0;
  for (const CallerRun& caller : *callers) {
    RETURN_IF_ERROR(caller.status);
    all.insert(all.end(), caller.latency_ms.begin(), caller.latency_ms.end());
    tokens += caller.x.dim(0) * static_cast<int64_t>(caller.latency_ms.size());
  }
  const double wall_s = absl::ToDoubleSeconds(last - first);
  Json out;
  out["forwards"] = static_cast<int64_t>(all.size());
  out["wall_s"] = Round3(wall_s);
  out["tokens_per_s"] = Round3(wall_s > 0 ? tokens / wall_s : 0.0);
  out["p50_ms"] = Round3(Percentile(all, 50));
  out["p99_ms"] = Round3(Percentile(all, 99));
  return out;
}

}  // namespace

int RunBenchCallers(int callers) {
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t warmup = absl::GetFlag(FLAGS_warmup);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  if (callers < 1 || callers > 1024 || steps <= 0 || warmup < 0 || tokens <= 0) {
    return UsageError("bench", "--callers is 1 to 1024, --steps and --tokens > 0, --warmup >= 0");
  }
  auto dtype = InputDTypeFromFlag();
  if (!dtype.ok()) return UsageError("bench", dtype.status().message());
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("bench", client.status());
  MoeClient& c = **client;
  const bool temporary = absl::GetFlag(FLAGS_layer).empty();
  const std::string name = LayerNameOr("bench-callers");
  bool usage_error = false;
  absl::StatusOr<v1::LayerInfo> info = OpenBenchLayer(c, name, temporary, *dtype, &usage_error);
  if (usage_error) return UsageError("bench", info.status().message());
  if (!info.ok()) return ReportError("bench", info.status());
  const int64_t hidden = info->config().hidden();

  std::vector<CallerRun> unbatched_runs(callers), batched_runs(callers);
  const uint64_t seed = absl::GetFlag(FLAGS_input_seed);
  for (int i = 0; i < callers; ++i) {
    unbatched_runs[i].x = RandomNormal(*dtype, {tokens, hidden}, seed + i);
    batched_runs[i].x = unbatched_runs[i].x;
  }
  absl::StatusOr<Json> off = RunCallers(c, name, true, warmup, steps, &unbatched_runs);
  absl::StatusOr<Json> on = off.ok() ? RunCallers(c, name, false, warmup, steps, &batched_runs)
                                     : off.status();
  if (temporary) c.DeleteLayer(name).IgnoreError();
  if (!on.ok()) return ReportError("bench", on.status());
  int differing = 0;
  double max_abs_diff = 0.0;
  for (int i = 0; i < callers; ++i) {
    const Tensor& got = batched_runs[i].last_out;
    const Tensor& want = unbatched_runs[i].last_out;
    if (got.bytes() == want.bytes() && batched_runs[i].last_counts == unbatched_runs[i].last_counts) {
      continue;
    }
    ++differing;
    const Tensor a = got.ConvertTo(DType::kFloat32), b = want.ConvertTo(DType::kFloat32);
    for (int64_t j = 0; j < a.num_elements(); ++j) {
      max_abs_diff = std::max<double>(max_abs_diff, std::fabs(a.data<float>()[j] - b.data<float>()[j]));
    }
  }
  const bool identical = differing == 0;
  Json out;
  out["server"] = c.target();
  out["layer"] = name;
  out["config"] = DescribeLayerConfig(info->config());
  out["ep_ranks"] = info->ep_ranks();
  out["callers"] = callers;
  out["tokens_per_caller"] = tokens;
  out["datatype"] = DTypeName(*dtype);
  out["steps_per_caller"] = steps;
  out["warmup"] = warmup;
  out["unbatched"] = *off;
  out["batched"] = *on;
  const double off_tps = (*off)["tokens_per_s"].get<double>();
  const double off_p99 = (*off)["p99_ms"].get<double>();
  out["tokens_per_s_ratio"] = Round3(off_tps > 0 ? (*on)["tokens_per_s"].get<double>() / off_tps : 0);
  out["p99_ratio"] = Round3(off_p99 > 0 ? (*on)["p99_ms"].get<double>() / off_p99 : 0);
  out["identical_to_unbatched"] = identical;
  out["callers_differing"] = differing;
  out["max_abs_diff"] = max_abs_diff;
  PrintJson(out);
  return identical ? 0 : 1;
}

}  // namespace cli
}  // namespace client
}  // namespace moe
