// moectl bench: throughput and latency of Forward and Forward+Backward through the service.
//
// Each timed step is measured on the client (wall clock around the RPCs), so the numbers
// include serialisation and the network hop: what a trainer calling moed would see.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/layer_flags.h"
#include "client/json_output.h"
#include "client/moectl.h"
#include "client/shared_memory.h"
#include "client/step_breakdown.h"
#include "client/tensor_util.h"
#include "engine/cuda/cuda_optional.h"
#include "engine/status_macros.h"

ABSL_FLAG(int64_t, steps, 20, "bench: timed steps of each kind.");
ABSL_FLAG(int64_t, warmup, 2, "bench: untimed steps of each kind first.");
ABSL_FLAG(bool, shm, false,
          "bench: also time the shared-memory path (x, out, d_out, d_x in a POSIX shm region; "
          "moed on this host with --allow_client_shm) and check its results are bit-identical "
          "to the gRPC path's");
ABSL_FLAG(bool, cuda_shm, false,
          "bench: also time the CUDA IPC path (x, out, d_out, d_x in this process's GPU memory, "
          "shared with cudaIpcGetMemHandle; CUDA workers on this host, moed with "
          "--allow_client_shm; moectl built with CUDA) and check its results are bit-identical "
          "to the gRPC path's");
ABSL_FLAG(int, cuda_shm_device, 0, "bench --cuda_shm: the GPU that holds the region.");
ABSL_FLAG(bool, compare_transports, false,
          "bench: when the steps went through the step channel (\"transport\": \"ring\"), "
          "also time them over gRPC calls in the same run (\"grpc\": the same series)");
ABSL_FLAG(bool, reuse_outputs, true,
          "bench: the gRPC path writes every step's out and d_x into one buffer each, kept across "
          "steps (MoeClient CallOptions::output), as a trainer with preallocated outputs does; "
          "false: a new tensor per step (its allocation and page faults timed too)");
ABSL_FLAG(int, concurrency, 1,
          "bench: also run this many callers at once (threads of one client, each with its own "
          "buffers), as perf_analyzer's --concurrency-range does: one caller's tensors travel "
          "while another's step computes, so tokens_per_s shows the overlap of transfer and "
          "compute; 1: only the one-caller measurement");
ABSL_FLAG(int, callers, 0,
          "bench: instead of the one-caller measurement, run this many inference callers at once "
          "(each its own x of --tokens tokens), first unbatched (a step per call), then with "
          "moed's cross-caller batching: tokens/s, p50 / p99 and their ratios, and whether every "
          "batched answer equals the caller's unbatched one (client/README.md)");
ABSL_FLAG(std::string, progress, "auto", "bench: progress bar on stderr: auto (if a tty)|on|off.");

namespace moe {
namespace client {
namespace cli {

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  // Nearest-rank on the sorted sample.
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * values.size()));
  return values[std::min(values.size() - 1, rank == 0 ? 0 : rank - 1)];
}

absl::StatusOr<v1::LayerInfo> OpenBenchLayer(MoeClient& c, const std::string& name,
                                             bool temporary, DType dtype, bool* usage_error) {
  absl::StatusOr<v1::LayerInfo> info;
  if (temporary) {
    auto config = LayerConfigFromFlags();
    if (!config.ok()) {
      *usage_error = true;
      return config.status();
    }
    if (absl::Status fits = CheckTokensFlag(config->hidden(), dtype); !fits.ok()) {
      *usage_error = true;
      return fits;
    }
    return c.CreateLayer(name, *config);
  }
  info = c.GetLayer(name);
  if (!info.ok()) return info;
  if (absl::Status fits = CheckTokensFlag(info->config().hidden(), dtype); !fits.ok()) {
    *usage_error = true;
    return fits;
  }
  return info;
}

namespace {

struct Series {
  std::vector<double> latency_ms;
  double wall_s = 0.0;
};

Json SeriesJson(const Series& s, int64_t tokens) {
  const double n = static_cast<double>(s.latency_ms.size());
  const double mean =
      n > 0 ? std::accumulate(s.latency_ms.begin(), s.latency_ms.end(), 0.0) / n : 0.0;
  const double steps_per_s = s.wall_s > 0 ? n / s.wall_s : 0.0;
  Json out;
  out["steps"] = static_cast<int64_t>(n);
  out["steps_per_s"] = Round3(steps_per_s);
  out["tokens_per_s"] = std::round(steps_per_s * tokens * 10.0) / 10.0;
  out["latency_ms"] = {
      {"mean", Round3(mean)},
      {"p50", Round3(Percentile(s.latency_ms, 50))},
      {"p90", Round3(Percentile(s.latency_ms, 90))},
      {"p99", Round3(Percentile(s.latency_ms, 99))},
      {"min", Round3(n > 0 ? *std::min_element(s.latency_ms.begin(), s.latency_ms.end()) : 0.0)},
      {"max", Round3(n > 0 ? *std::max_element(s.latency_ms.begin(), s.latency_ms.end()) : 0.0)}};
  return out;
}

class ProgressBar {
 public:
  ProgressBar(int64_t total, bool enabled) : total_(total), enabled_(enabled) {}
  void Update(int64_t done, const char* phase) {
    if (!enabled_) return;
    constexpr int kWidth = 30;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : kWidth;
    std::fprintf(stderr, "\r%-16s [%s%s] %lld/%lld", phase, std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, '.').c_str(), static_cast<long long>(done),
                 static_cast<long long>(total_));
    if (done == total_) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  const int64_t total_;
  const bool enabled_;
};

// Runs `warmup` + `steps` calls of `step`, timing the last `steps`; record(latency_ms) after
// each timed one.
absl::StatusOr<Series> Measure(int64_t warmup, int64_t steps, const char* phase, bool show_progress,
                               const std::function<absl::Status()>& step,
                               const std::function<void(double)>& record) {
  ProgressBar bar(warmup + steps, show_progress);
  Series series;
  absl::Time start = absl::Now();
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup) start = absl::Now();
    const absl::Time t0 = absl::Now();
    absl::Status status = step();
    if (!status.ok()) return status;
    if (i >= warmup) {
      series.latency_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      record(series.latency_ms.back());
    }
    bar.Update(i + 1, phase);
  }
  series.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  return series;
}

// Times `warmup` + `steps` forwards, then as many forward+backward steps, each asking for its
// StepTiming through the CallOptions it is given (a few clock reads), so that the timed steps'
// breakdown is recorded. `label`: the progress bar's prefix. Returns {"forward",
// "forward_backward", "breakdown": {"forward", "forward_backward"}}.
absl::StatusOr<Json> MeasureSteps(
    int64_t warmup, int64_t steps, const std::string& label, bool show_progress, int64_t tokens,
    const std::function<absl::Status(const CallOptions& fwd)>& forward_step,
    const std::function<absl::Status(const CallOptions& fwd, const CallOptions& bwd)>&
        training_step) {
  StepTimes fwd_times, bwd_times;
  CallOptions fwd_call, bwd_call;
  fwd_call.timing = &fwd_times;
  bwd_call.timing = &bwd_times;
  StepBreakdown forward_breakdown, training_breakdown;
  const std::string forward_label = label + "forward";
  const std::string training_label = label + "forward+backward";
  auto forward_once = [&]() { return forward_step(fwd_call); };
  auto training_once = [&]() { return training_step(fwd_call, bwd_call); };
  auto record_forward = [&](double ms) { forward_breakdown.Add(ms, {&fwd_times}); };
  auto record_training = [&](double ms) { training_breakdown.Add(ms, {&fwd_times, &bwd_times}); };
  ASSIGN_OR_RETURN(Series forward, Measure(warmup, steps, forward_label.c_str(), show_progress,
                                           forward_once, record_forward));
  ASSIGN_OR_RETURN(Series training, Measure(warmup, steps, training_label.c_str(), show_progress,
                                            training_once, record_training));
  Json out;
  out["forward"] = SeriesJson(forward, tokens);
  out["forward_backward"] = SeriesJson(training, tokens);
  out["breakdown"]["forward"] = forward_breakdown.ToJson();
  out["breakdown"]["forward_backward"] = training_breakdown.ToJson();
  return out;
}

// A region for BenchShm: `write` puts bytes at an offset, `read` gets them back.
struct BenchRegion {
  std::function<absl::Status(int64_t offset, absl::string_view bytes)> write;
  std::function<absl::StatusOr<std::string>(int64_t offset, int64_t size)> read;
  std::shared_ptr<void> hold;  // frees the region's memory
};

// A POSIX shm region of `size` bytes registered as `name`.
absl::StatusOr<BenchRegion> SystemRegion(MoeClient& c, const std::string& name, int64_t size) {
  const std::string key = absl::StrCat("/moectl-bench-", getpid());
  ASSIGN_OR_RETURN(std::shared_ptr<SharedMemoryRegion> shm, SharedMemoryRegion::Create(key, size));
  RETURN_IF_ERROR(c.RegisterSystemSharedMemory(name, key, 0, shm->size()));
  BenchRegion region;
  region.write = [shm](int64_t offset, absl::string_view bytes) {
    std::memcpy(shm->data() + offset, bytes.data(), bytes.size());
    return absl::OkStatus();
  };
  region.read = [shm](int64_t offset, int64_t n) -> absl::StatusOr<std::string> {
    return std::string(shm->data() + offset, n);
  };
  region.hold = shm;
  return region;
}

// `size` bytes of GPU memory on --cuda_shm_device, shared by CUDA IPC and registered as `name`.
absl::StatusOr<BenchRegion> CudaRegion(MoeClient& c, const std::string& name, int64_t size) {
  const int device = absl::GetFlag(FLAGS_cuda_shm_device);
  ASSIGN_OR_RETURN(void* memory, OptionalAllocateSharableDeviceMemory(device, size));
  std::shared_ptr<void> hold(memory, [](void* p) { OptionalFreeDeviceMemory(p).IgnoreError(); });
  ASSIGN_OR_RETURN(std::string handle, OptionalCudaIpcHandleOf(memory));
  RETURN_IF_ERROR(c.RegisterCudaSharedMemory(name, handle, device, size));
  char* base = static_cast<char*>(memory);
  BenchRegion region;
  region.write = [base](int64_t offset, absl::string_view bytes) {
    return OptionalCopyMemory(base + offset, bytes.data(), bytes.size());
  };
  region.read = [base](int64_t offset, int64_t n) -> absl::StatusOr<std::string> {
    std::string out(n, '\0');
    RETURN_IF_ERROR(OptionalCopyMemory(out.data(), base + offset, n));
    return out;
  };
  region.hold = std::move(hold);
  return region;
}

// The shared-memory path: one region (POSIX shm, or with `cuda` GPU memory shared by CUDA IPC)
// holds [x | out | d_out | d_x]; out and d_x of the first step are compared bitwise with the
// gRPC path's. Returns the "shm" / "cuda_shm" JSON object.
absl::StatusOr<Json> BenchShm(MoeClient& c, const std::string& layer, const Tensor& x,
                              const Tensor& d_out, int64_t warmup, int64_t steps,
                              bool show_progress, bool cuda) {
  const int64_t bytes = static_cast<int64_t>(x.num_bytes());
  const std::string region = absl::StrCat(cuda ? "moectl-bench-cuda-" : "moectl-bench-", getpid());
  const int64_t size = std::max<int64_t>(1, 4 * bytes);
  ASSIGN_OR_RETURN(BenchRegion shm, cuda ? CudaRegion(c, region, size)
                                         : SystemRegion(c, region, size));
  if (bytes > 0) {
    RETURN_IF_ERROR(shm.write(0, x.bytes()));
    RETURN_IF_ERROR(shm.write(2 * bytes, d_out.bytes()));
  }
  const ShmTensorRef x_ref{region, 0, x.dtype(), x.shape()};
  const ShmOutputRef out_ref{region, bytes, bytes};
  const ShmTensorRef d_out_ref{region, 2 * bytes, d_out.dtype(), d_out.shape()};
  const ShmOutputRef d_x_ref{region, 3 * bytes, bytes};
  auto run = [&]() -> absl::StatusOr<Json> {
    // Bit-identical to the gRPC path (the server is deterministic).
    ASSIGN_OR_RETURN(ForwardOutput grpc_fwd, c.Forward(layer, x, /*keep_for_backward=*/true));
    ASSIGN_OR_RETURN(Tensor grpc_d_x, c.Backward(layer, grpc_fwd.step_id, d_out));
    ASSIGN_OR_RETURN(ForwardOutput fwd, c.ForwardShm(layer, x_ref, out_ref, true));
    RETURN_IF_ERROR(c.BackwardShm(layer, fwd.step_id, d_out_ref, d_x_ref));
    ASSIGN_OR_RETURN(const std::string shm_out, shm.read(bytes, bytes));
    ASSIGN_OR_RETURN(const std::string shm_d_x, shm.read(3 * bytes, bytes));
    const bool identical = grpc_fwd.out.bytes() == shm_out && grpc_d_x.bytes() == shm_d_x;
    // The same per-phase breakdown as the gRPC path's (encode and decode are 0: no bytes in
    // the messages).
    ASSIGN_OR_RETURN(
        Json timed,
        MeasureSteps(
            warmup, steps, cuda ? "cuda shm " : "shm ", show_progress, x.dim(0),
            [&](const CallOptions& fwd_call) {
              return c.ForwardShm(layer, x_ref, out_ref, false, fwd_call).status();
            },
            [&](const CallOptions& fwd_call, const CallOptions& bwd_call) -> absl::Status {
              ASSIGN_OR_RETURN(ForwardOutput f,
                               c.ForwardShm(layer, x_ref, out_ref, true, fwd_call));
              absl::Status backward = c.BackwardShm(layer, f.step_id, d_out_ref, d_x_ref,
                                                    std::nullopt, std::nullopt, bwd_call);
              if (!backward.ok()) c.ReleaseStep(layer, f.step_id).IgnoreError();
              return backward;
            }));
    Json out;
    out["identical_to_grpc"] = identical;
    for (const auto& [key, value] : timed.items()) out[key] = value;
    return out;
  };
  absl::StatusOr<Json> json = run();
  c.UnregisterSystemSharedMemory(region).IgnoreError();
  return json;
}

// The gRPC path (MeasureSteps' JSON, and "output_buffers": "reused" or "new").
absl::StatusOr<Json> BenchGrpc(MoeClient& c, const std::string& layer, const Tensor& x,
                               const Tensor& d_out, int64_t warmup, int64_t steps,
                               bool show_progress) {
  const bool reuse = absl::GetFlag(FLAGS_reuse_outputs);
  Tensor out_buffer = Tensor::Uninitialized(x.dtype(), x.shape());
  Tensor d_x_buffer = Tensor::Uninitialized(d_out.dtype(), d_out.shape());
  // The call's options, writing into `buffer` when outputs are reused.
  auto into = [reuse](const CallOptions& call, Tensor* buffer) {
    CallOptions with = call;
    if (reuse) with.output = buffer;
    return with;
  };
  ASSIGN_OR_RETURN(
      Json out,
      MeasureSteps(
          warmup, steps, "", show_progress, x.dim(0),
          [&](const CallOptions& fwd_call) {
            return c.Forward(layer, x, /*keep_for_backward=*/false, into(fwd_call, &out_buffer))
                .status();
          },
          [&](const CallOptions& fwd_call, const CallOptions& bwd_call) -> absl::Status {
            auto fwd = c.Forward(layer, x, /*keep_for_backward=*/true, into(fwd_call, &out_buffer));
            if (!fwd.ok()) return fwd.status();
            absl::Status backward = c.Backward(layer, fwd->step_id, d_out, std::nullopt,
                                               std::nullopt, into(bwd_call, &d_x_buffer))
                                        .status();
            // A Backward that failed before reaching the workers leaves the step saved: free
            // it, or an existing layer keeps it until the server's --saved_step_ttl_s.
            if (!backward.ok()) c.ReleaseStep(layer, fwd->step_id).IgnoreError();
            return backward;
          }));
  out["output_buffers"] = reuse ? "reused" : "new";
  return out;
}

// `callers` threads at once, each running `warmup` + `steps` forwards, then as many
// forward+backward steps, into its own output buffers; every caller's first forward is
// compared bitwise with `want_out` (forwards change nothing, so they all equal it). Returns
// {"concurrency", "identical_to_one_caller", "forward", "forward_backward"}: latencies of all
// callers' timed steps, steps_per_s and tokens_per_s over the wall time of all of them.
absl::StatusOr<Json> BenchConcurrent(MoeClient& c, const std::string& layer, const Tensor& x,
                                     const Tensor& d_out, const Tensor& want_out, int callers,
                                     int64_t warmup, int64_t steps) {
  struct Caller {
    Tensor out, d_x;
    Series forward, training;
    bool identical = false;
    absl::Status status;
  };
  std::vector<Caller> all(callers);
  // One kind of step on every caller at once; the wall time from the first timed step of any
  // caller to the last one's end.
  auto run = [&](bool training) -> absl::Status {
    absl::Mutex mu;
    absl::Time first = absl::InfiniteFuture(), last = absl::InfinitePast();
    std::vector<std::thread> threads;
    for (Caller& caller : all) {
      caller.out = Tensor::Uninitialized(x.dtype(), x.shape());
      caller.d_x = Tensor::Uninitialized(d_out.dtype(), d_out.shape());
      threads.emplace_back([&, training] {
        CallOptions into_out, into_d_x;
        into_out.output = &caller.out;
        into_d_x.output = &caller.d_x;
        Series& series = training ? caller.training : caller.forward;
        for (int64_t i = 0; i < warmup + steps && caller.status.ok(); ++i) {
          const absl::Time t0 = absl::Now();
          if (i == warmup) {
            absl::MutexLock lock(&mu);
            first = std::min(first, t0);
          }
          auto fwd = c.Forward(layer, x, /*keep_for_backward=*/training, into_out);
          if (!fwd.ok()) {
            caller.status = fwd.status();
            break;
          }
          if (i == 0 && !training) caller.identical = caller.out.bytes() == want_out.bytes();
          if (training) {
            caller.status = c.Backward(layer, fwd->step_id, d_out, std::nullopt, std::nullopt,
                                       into_d_x)
                                .status();
            if (!caller.status.ok()) c.ReleaseStep(layer, fwd->step_id).IgnoreError();
          }
          const absl::Time t1 = absl::Now();
          if (i >= warmup) series.latency_ms.push_back(absl::ToDoubleMilliseconds(t1 - t0));
          if (i + 1 == warmup + steps) {
            absl::MutexLock lock(&mu);
            last = std::max(last, t1);
          }
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (Caller& caller : all) {
      RETURN_IF_ERROR(caller.status);
      (training ? caller.training : caller.forward).wall_s = absl::ToDoubleSeconds(last - first);
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(run(/*training=*/false));
  RETURN_IF_ERROR(run(/*training=*/true));
  Series forward, training;
  bool identical = true;
  for (const Caller& caller : all) {
    identical = identical && caller.identical;
    for (const auto& [from, to] : {std::make_pair(&caller.forward, &forward),
                                   std::make_pair(&caller.training, &training)}) {
      to->latency_ms.insert(to->latency_ms.end(), from->latency_ms.begin(),
                            from->latency_ms.end());
      to->wall_s = from->wall_s;
    }
  }
  Json out;
  out["concurrency"] = callers;
  out["identical_to_one_caller"] = identical;
  out["forward"] = SeriesJson(forward, x.dim(0));
  out["forward_backward"] = SeriesJson(training, x.dim(0));
  return out;
}

}  // namespace

int RunBench(const Args& args) {
  if (!args.empty()) return UsageError("bench", "takes no positional arguments");
  if (absl::GetFlag(FLAGS_callers) != 0) return RunBenchCallers(absl::GetFlag(FLAGS_callers));
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t warmup = absl::GetFlag(FLAGS_warmup);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  if (steps <= 0 || warmup < 0 || tokens < 0) {
    return UsageError("bench", "--steps must be > 0, --warmup and --tokens >= 0");
  }
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  if (concurrency < 1 || concurrency > 64) {
    return UsageError("bench", "--concurrency is 1 to 64");
  }
  const std::string progress = absl::GetFlag(FLAGS_progress);
  if (progress != "auto" && progress != "on" && progress != "off") {
    return UsageError("bench", "--progress is auto, on or off");
  }
  const bool show_progress = progress == "on" || (progress == "auto" && isatty(2));
  auto dtype = InputDTypeFromFlag();
  if (!dtype.ok()) return UsageError("bench", dtype.status().message());
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("bench", client.status());

  // An existing layer when --layer names one; otherwise a temporary one from the layer flags.
  const bool temporary = absl::GetFlag(FLAGS_layer).empty();
  const std::string name = LayerNameOr("bench");
  bool usage_error = false;
  absl::StatusOr<v1::LayerInfo> info = OpenBenchLayer(**client, name, temporary, *dtype,
                                                      &usage_error);
  if (usage_error) return UsageError("bench", info.status().message());
  if (!info.ok()) return ReportError("bench", info.status());

  const int64_t hidden = info->config().hidden();
  const uint64_t seed = absl::GetFlag(FLAGS_input_seed);
  const Tensor x = RandomNormal(*dtype, {tokens, hidden}, seed);
  const Tensor d_out = RandomNormal(*dtype, {tokens, hidden}, seed + 1);
  MoeClient& c = **client;

  absl::StatusOr<Json> grpc_json = BenchGrpc(c, name, x, d_out, warmup, steps, show_progress);
  // How those steps travelled; with --compare_transports the same over gRPC calls.
  const char* transport = c.steps_over_channel() > 0 && c.step_channel_on() ? "ring" : "grpc";
  absl::StatusOr<Json> over_grpc = Json();
  if (absl::GetFlag(FLAGS_compare_transports) && grpc_json.ok() &&
      std::string(transport) == "ring") {
    absl::StatusOr<std::unique_ptr<MoeClient>> plain = ConnectFromFlags(/*step_channel=*/false);
    over_grpc = plain.ok() ? BenchGrpc(**plain, name, x, d_out, warmup, steps, show_progress)
                           : plain.status();
  }
  absl::StatusOr<Json> concurrent_json = Json();
  if (concurrency > 1 && grpc_json.ok()) {
    absl::StatusOr<ForwardOutput> want = c.Forward(name, x);
    concurrent_json = want.ok() ? BenchConcurrent(c, name, x, d_out, want->out, concurrency,
                                                  warmup, steps)
                                : want.status();
  }
  absl::StatusOr<Json> shm_json = Json();
  if (absl::GetFlag(FLAGS_shm) && grpc_json.ok()) {
    shm_json = BenchShm(c, name, x, d_out, warmup, steps, show_progress, /*cuda=*/false);
  }
  absl::StatusOr<Json> cuda_shm_json = Json();
  if (absl::GetFlag(FLAGS_cuda_shm) && grpc_json.ok() && shm_json.ok()) {
    cuda_shm_json = BenchShm(c, name, x, d_out, warmup, steps, show_progress, /*cuda=*/true);
  }
  // Gradients accumulated by the timed backwards are dropped so an existing layer is left as
  // it was found, apart from its counters.
  if (temporary) {
    c.DeleteLayer(name).IgnoreError();
  } else {
    c.ZeroGradients(name).IgnoreError();
  }
  if (!grpc_json.ok()) return ReportError("bench", grpc_json.status());
  if (!over_grpc.ok()) return ReportError("bench", over_grpc.status());
  if (!concurrent_json.ok()) return ReportError("bench", concurrent_json.status());
  if (!shm_json.ok()) return ReportError("bench", shm_json.status());
  if (!cuda_shm_json.ok()) return ReportError("bench", cuda_shm_json.status());

  Json out;
  out["server"] = c.target();
  out["layer"] = name;
  out["config"] = DescribeLayerConfig(info->config());
  out["ep_ranks"] = info->ep_ranks();
  out["tokens"] = tokens;
  out["datatype"] = DTypeName(*dtype);
  out["warmup"] = warmup;
  out["transport"] = transport;
  for (const auto& [key, value] : grpc_json->items()) out[key] = value;
  if (!over_grpc->is_null()) out["grpc"] = *std::move(over_grpc);
  if (!concurrent_json->is_null()) out["concurrent"] = *std::move(concurrent_json);
  if (!shm_json->is_null()) out["shm"] = *std::move(shm_json);
  if (!cuda_shm_json->is_null()) out["cuda_shm"] = *std::move(cuda_shm_json);
  PrintJson(out);
  return 0;
}

}  // namespace cli
}  // namespace client
}  // namespace moe
