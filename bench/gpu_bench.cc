// gpu_bench: the MoE layer on CUDA, forward and forward+backward, one JSON object per config
// on stdout (and appended to --json). Single GPU (--size=1, NCCL with one rank) or one rank of
// an expert-parallel group (--size=R --rank=r, ranks joined through a file store in
// --store_dir; weak scaling: every rank gets the preset's token count, as GPU.md's PyTorch
// EP=2 runs do).
//
//   gpu_bench --configs=te_seed,mixtral --iters=10
//   gpu_bench --configs=mixtral --compute_dtypes=bf16,fp8   # each preset in both, back to back
//   gpu_bench --configs=dsv3 --zero_grads=false             # accumulating fwd+bwd steps
//   gpu_bench --configs=dsv3 --accumulating_iters=8          # zeroed steps, then accumulating
//   gpu_bench --size=2 --rank=0 --store_dir=/tmp/s & gpu_bench --size=2 --rank=1 --store_dir=/tmp/s
//
// Times (medians over --iters steps after --warmup):
//   *_ms         MoeLayer API time, host tensors in and out (x and d_out pinned by the bench);
//   *_device_ms  the sum of the step's device operations (each timed between CUDA events on
//                the stream: kernels, GEMMs, collectives), i.e. device-resident without the
//                layer's host<->device copies and without host gaps: comparable with GPU.md's
//                PyTorch/JAX columns, which time device-resident tensors;
//   *_span_ms    from the start of the step's first device operation to the end of its last:
//                device-resident including the host round trips inside the step (the one
//                count exchange the dispatch needs) and host launch gaps;
//   *_copy_ms    the layer's host<->device copies; host = API - device - copies.
// `breakdown_fwdbwd_ms` splits the median-free mean fwd+bwd device time by operation.
// Gradients (`zero_grads` in the JSON): with --zero_grads (the default) the layer's gradients
// are zeroed before every timed fwd+bwd step, as a training loop's zero_grad does, so every
// step writes its weight gradients (GEMM beta = 0) and the median is of such steps. The
// engine's ZeroGradients is lazy (a host flag, no device work); the call sits outside the
// timed window and its own cost is reported as zero_grads_host_ms / zero_grads_device_ms.
// Each zeroed step ends with FlushGradients inside its timed window: the engine may defer the
// expert weight gradients' GEMMs (docs/SPEC.md "Weight gradients of several backwards"), and a
// step is only done when its gradients exist.
// --zero_grads=false keeps accumulating steps (beta = 1 into the fp32 gradients) after the
// first timed one, which follows a zeroing. --accumulating_iters=N (with --zero_grads) times N
// more fwd+bwd steps without zeroing in the same process, as fwdbwd_accum_device_ms[_all] and
// breakdown_fwdbwd_accum_ms: both kinds of step for one layer creation (dsv3's takes ~55 s).
// Accumulating steps do not flush: the one FlushGradients after the last is timed on its own
// (fwdbwd_[accum_]flush_device_ms) and fwdbwd_[accum_]mean_device_ms is the series' total
// device time, that flush included, per step. The median of such steps leaves out the
// deferred GEMMs that some of them (the one filling the budget) or the flush ran: compare
// accumulating steps by the mean.
// `fingerprint`: FNV-1a 64 of out, d_x and the gate gradient of one fwd+bwd step from zero
// gradients after the warm-up, then of the wi and wo gradients after a second, accumulating
// step ("-" where they are too large to hash: dsv3's); two builds printing the same one
// computed the same bits.
// `tuned_gemm_plans` / `tuned_gemm_refused`: the process's GEMM plans so far that took
// engine/cuda/cublaslt_plans.h's configuration, and the GEMMs cuBLASLt refused one for at their
// exact shape (each ran the heuristic's choice instead).
// TFLOP/s count the expert FFN only: 2*T*k*H*3F per forward (gated), x3 with backward.
// EP runs add the dispatch/combine all-to-all (bytes each rank sends, its own part included,
// over the exchange time; bus bandwidth = that x (R-1)/R, nccl-tests' definition) and a
// standalone AllToAllV of the same size.
#include <cuda_runtime.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/gpu_timing.h"
#include "bench/presets.h"
#include "engine/comm/file_kv_store.h"
#include "engine/comm/memory_kv_store.h"
#include "engine/comm/nccl_communicator.h"
#include "engine/cuda/cublaslt_plans.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/moe_layer.h"
#include "engine/status_macros.h"
#include "server/engine_flags.h"

ABSL_FLAG(std::string, configs, "te_seed,qwen3,mixtral,dsv3", "presets to run, in order");
ABSL_FLAG(int, iters, 10, "timed steps of each kind");
ABSL_FLAG(int, warmup, 3, "untimed forward+backward steps first");
ABSL_FLAG(int, rank, 0, "this rank");
ABSL_FLAG(int, size, 1, "EP ranks");
ABSL_FLAG(int, device, -1, "CUDA device (default: --rank)");
ABSL_FLAG(std::string, store_dir, "", "file store directory shared by the ranks (--size > 1)");
ABSL_FLAG(std::string, json, "", "also append each JSON line to this file");
ABSL_FLAG(int64_t, tokens, -1, "override T (per rank)");
ABSL_FLAG(std::string, compute_dtypes, "bf16",
          "compute datatypes to run each preset in, in order (bf16, fp8, fp32), e.g. bf16,fp8");
ABSL_FLAG(std::string, fp8_recipes, "DELAYED",
          "FP8 scaling recipes to run each FP8 preset in, in order (DELAYED, CURRENT)");
ABSL_FLAG(std::string, fp8_gemms, "AUTO",
          "fp8_gemms policies to run each FP8 preset and recipe in, in order, separated by ';' "
          "(AUTO, ALL, none, a set such as fc1_fprop,fc1_dgrad, ALL-<gemm> for every GEMM but "
          "one, or each: ALL-<gemm> for each of the six GEMMs in turn)");
ABSL_FLAG(bool, zero_grads, true,
          "zero the layer's gradients before every timed fwd+bwd step (outside the timed "
          "window); false: accumulating steps, as before");
ABSL_FLAG(int, accumulating_iters, 0,
          "with --zero_grads: this many more fwd+bwd steps without zeroing, reported as "
          "fwdbwd_accum_*");

namespace moe {
namespace {

using Preset = BenchPreset;

void Progress(const std::string& what) {
  static const double start =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const double now =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  std::fprintf(stderr, "[gpu_bench rank %d %7.1fs] %s\n", absl::GetFlag(FLAGS_rank), now - start,
               what.c_str());
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Deterministic pseudo-normal-ish bf16 data (sum of uniforms), fast enough for 10^8 elements.
Tensor RandomBf16(int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = Tensor::Zeros(DType::kBFloat16, {rows, cols});
  uint16_t* p = t.data<uint16_t>();
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < rows * cols; ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const float u = static_cast<float>((s >> 40) & 0xffffff) / 16777216.0f;
    const float v = static_cast<float>((s >> 16) & 0xffffff) / 16777216.0f;
    p[i] = FloatToBf16((u + v - 1.0f) * 2.4f);
  }
  return t;
}

std::string Json(const std::vector<std::pair<std::string, std::string>>& kv) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : kv) parts.push_back(absl::StrCat("\"", k, "\": ", v));
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}
std::string Num(double v) { return absl::StrCat(v); }
std::string Str(const std::string& s) { return absl::StrCat("\"", s, "\""); }
std::string List(const std::vector<double>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
}

// A standalone AllToAllV moving `bytes` per rank split evenly over the ranks.
absl::StatusOr<double> StandaloneA2aMs(Backend* backend, Communicator* comm, size_t bytes) {
  const int R = comm->size();
  const size_t part = bytes / R / 256 * 256;
  if (part == 0) return 0.0;
  ASSIGN_OR_RETURN(Buffer send, backend->Allocate(part * R));
  ASSIGN_OR_RETURN(Buffer recv, backend->Allocate(part * R));
  RETURN_IF_ERROR(backend->Memset(send.data(), 1, part * R));
  std::vector<size_t> sizes(R, part);
  bench::TimingCommunicator tc(comm, backend->stream());
  for (int i = 0; i < 3; ++i) RETURN_IF_ERROR(tc.AllToAllV(send.data(), sizes, recv.data(), sizes));
  RETURN_IF_ERROR(backend->Synchronize());
  std::vector<double> ms;
  for (int i = 0; i < 20; ++i) {
    tc.exchanges().Reset();
    RETURN_IF_ERROR(tc.AllToAllV(send.data(), sizes, recv.data(), sizes));
    ms.push_back(tc.exchanges().TotalMs());
  }
  return Median(ms);
}

// Medians' inputs of one kind of step (one entry per timed step).
struct Series {
  std::vector<double> api, device, span, copy, a2a_ms, a2a_bytes, zero_host, zero_device;
  double flush_device = 0;  // the FlushGradients after an accumulating series (device ms)
};

// One layer and its timing decorators: runs and times steps.
class StepTimer {
 public:
  StepTimer(MoeLayer* layer, bench::TimingBackend* tb, bench::TimingCommunicator* tc,
            const Tensor* x, const Tensor* d_out, int size)
      : layer_(layer), tb_(tb), tc_(tc), x_(x), d_out_(d_out), size_(size) {}

  absl::Status Step(bool backward) {
    std::unique_ptr<StepContext> saved;
    ASSIGN_OR_RETURN(ForwardResult fwd, layer_->Forward(*x_, backward ? &saved : nullptr));
    if (!backward) return absl::OkStatus();
    ASSIGN_OR_RETURN(Tensor d_x, layer_->Backward(*saved, *d_out_, 1.0, 1.0));
    (void)d_x;
    return absl::OkStatus();
  }

  // A bitwise fingerprint of one fwd+bwd step from zero gradients: FNV-1a 64 of out, d_x and
  // the gate gradient (d_x sums every path of the backward: expert rows, d_probs, router), to
  // compare two builds' results on the GPU (kernel changes that must keep every bit). Then a
  // second fwd+bwd accumulates into those gradients, and the expert weight gradients (wi, wo)
  // after both steps are added, when each is at most kMaxHashedGradientBytes (dsv3's are 30
  // and 15 GB: "-" instead).
  absl::StatusOr<std::string> Fingerprint() {
    RETURN_IF_ERROR(layer_->ZeroGradients());
    std::unique_ptr<StepContext> saved;
    ASSIGN_OR_RETURN(ForwardResult fwd, layer_->Forward(*x_, &saved));
    ASSIGN_OR_RETURN(Tensor d_x, layer_->Backward(*saved, *d_out_, 1.0, 1.0));
    ASSIGN_OR_RETURN(Tensor d_gate, layer_->GetGradient("gate"));
    std::string fp = absl::StrCat(Fnv(fwd.out), "-", Fnv(d_x), "-", Fnv(d_gate));
    RETURN_IF_ERROR(layer_->Forward(*x_, &saved).status());
    RETURN_IF_ERROR(layer_->Backward(*saved, *d_out_, 1.0, 1.0).status());
    for (const char* name : {"wi", "wo"}) {
      const LayerConfig& c = layer_->config();
      const int64_t bytes = static_cast<int64_t>(sizeof(float)) * c.num_experts / size_ * c.hidden *
                            (std::string(name) == "wi" ? UpWidth(c) : c.ffn);
      if (bytes > kMaxHashedGradientBytes) {
        absl::StrAppend(&fp, "--");
        continue;
      }
      ASSIGN_OR_RETURN(Tensor grad, layer_->GetGradient(name));
      absl::StrAppend(&fp, "-", Fnv(grad));
    }
    return fp;
  }
  static constexpr int64_t kMaxHashedGradientBytes = int64_t{4} << 30;

  static std::string Fnv(const Tensor& t) {
    uint64_t h = 0xcbf29ce484222325ull;
    const unsigned char* p = static_cast<const unsigned char*>(t.raw());
    for (size_t i = 0; i < t.num_bytes(); ++i) h = (h ^ p[i]) * 0x100000001b3ull;
    return absl::StrCat(absl::Hex(h, absl::kZeroPad16));
  }

  void ResetLogs() {
    tb_->copies().Reset(), tb_->ops().Reset(), tc_->exchanges().Reset(), tc_->others().Reset();
  }

  // `iters` timed steps; `zero`: ZeroGradients before each, timed apart from the step (host
  // time, and the device ops it enqueues: none while the engine zeroes lazily), and
  // FlushGradients after each fwd+bwd inside its step (a zeroed step is a whole training step:
  // its weight gradients must exist before the next zeroing). Without `zero` the fwd+bwd steps
  // accumulate and one FlushGradients after the last is timed into out->flush_device.
  // Per-operation device times are added into `breakdown` when it is given.
  absl::Status Time(bool backward, bool zero, int iters, Series* out,
                    std::map<std::string, double>* breakdown) {
    for (int i = 0; i < iters; ++i) {
      if (size_ > 1) RETURN_IF_ERROR(tc_->Barrier());
      if (zero) {
        ResetLogs();
        const double z0 = NowMs();
        RETURN_IF_ERROR(layer_->ZeroGradients());
        out->zero_host.push_back(NowMs() - z0);
        out->zero_device.push_back(tb_->ops().TotalMs());
      }
      ResetLogs();
      const double t0 = NowMs();
      RETURN_IF_ERROR(Step(backward));
      if (backward && zero) RETURN_IF_ERROR(layer_->FlushGradients());
      const double total = NowMs() - t0;
      size_t ex_bytes = 0;
      const double ex = tc_->exchanges().TotalMs(&ex_bytes);
      out->api.push_back(total);
      out->device.push_back(tb_->ops().TotalMs() + ex + tc_->others().TotalMs());
      out->span.push_back(tb_->ops().SpanMs());
      out->copy.push_back(tb_->copies().TotalMs());
      out->a2a_ms.push_back(ex);
      out->a2a_bytes.push_back(static_cast<double>(ex_bytes));
      if (breakdown != nullptr) {
        tb_->ops().AddByName(breakdown);
        tc_->exchanges().AddByName(breakdown);
        tc_->others().AddByName(breakdown);
        tb_->copies().AddByName(breakdown);
      }
    }
    if (backward && !zero) {
      ResetLogs();
      RETURN_IF_ERROR(layer_->FlushGradients());
      out->flush_device = tb_->ops().TotalMs();
      if (breakdown != nullptr) tb_->ops().AddByName(breakdown);
    }
    return absl::OkStatus();
  }

 private:
  MoeLayer* layer_;
  bench::TimingBackend* tb_;
  bench::TimingCommunicator* tc_;
  const Tensor *x_, *d_out_;
  int size_;
};

std::string BreakdownJson(const std::map<std::string, double>& breakdown, int iters) {
  std::vector<std::string> parts;
  for (const auto& [name, ms] : breakdown) {
    parts.push_back(absl::StrCat("\"", name, "\": ", ms / iters));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

// The EP exchange figures and a standalone AllToAllV of one dispatch's size.
absl::Status AddExchangeFields(const Preset& p, int64_t T, Backend* cuda, Communicator* nccl,
                               const Series* series,
                               std::vector<std::pair<std::string, std::string>>* kv) {
  const int n = absl::GetFlag(FLAGS_size);
  const double ms = Median(series[0].a2a_ms), bytes = Median(series[0].a2a_bytes);
  const double alg = bytes / (ms / 1000) / 1e9;
  kv->push_back({"fwd_a2a_ms", Num(ms)});
  kv->push_back({"fwd_a2a_bytes", Num(bytes)});
  kv->push_back({"fwd_a2a_calls", Num(2)});
  kv->push_back({"a2a_algbw_GBps", Num(alg)});
  kv->push_back({"a2a_busbw_GBps", Num(alg * (n - 1) / n)});
  kv->push_back({"fwdbwd_a2a_ms", Num(Median(series[1].a2a_ms))});
  // One standalone AllToAllV of the size of one dispatch (every rank sends T*k rows of H
  // bf16 values, its own part included; the same on every rank so that sizes match).
  const size_t dispatch_bytes = static_cast<size_t>(T * p.top_k * p.hidden * 2);
  ASSIGN_OR_RETURN(double standalone_ms, StandaloneA2aMs(cuda, nccl, dispatch_bytes));
  const double s_alg = dispatch_bytes / (standalone_ms / 1000) / 1e9;
  kv->push_back({"standalone_a2a_bytes", Num(dispatch_bytes)});
  kv->push_back({"standalone_a2a_ms", Num(standalone_ms)});
  kv->push_back({"standalone_a2a_busbw_GBps", Num(s_alg * (n - 1) / n)});
  return absl::OkStatus();
}

// The FP8 recipe and GEMM policy of the run in progress (Main sets them before each FP8
// RunConfig).
Fp8Recipe current_fp8_recipe = Fp8Recipe::kDelayed;
Fp8GemmsPolicy current_fp8_gemms;

// --fp8_gemms: each item a policy (ParseFp8GemmsPolicy), "ALL-<gemm>" (every GEMM but that
// one) or "each" (ALL-<gemm> for the six in turn).
absl::StatusOr<std::vector<Fp8GemmsPolicy>> ParseFp8GemmsFlag(absl::string_view text) {
  std::vector<Fp8GemmsPolicy> out;
  auto all_but = [](Fp8Gemm g) {
    Fp8GemmsPolicy p;
    p.kind = Fp8GemmsPolicy::Kind::kSet;
    p.set = kAllFp8Gemms & ~Fp8GemmBit(g);
    return p;
  };
  for (absl::string_view item : absl::StrSplit(text, ';', absl::SkipEmpty())) {
    if (item == "each") {
      for (int i = 0; i < kFp8GemmCount; ++i) out.push_back(all_but(static_cast<Fp8Gemm>(i)));
    } else if (absl::StartsWith(item, "ALL-")) {
      ASSIGN_OR_RETURN(Fp8GemmsPolicy one, ParseFp8GemmsPolicy(item.substr(4)));
      if (one.kind != Fp8GemmsPolicy::Kind::kSet || __builtin_popcount(one.set) != 1) {
        return absl::InvalidArgumentError(absl::StrCat("--fp8_gemms: '", item, "' names no GEMM"));
      }
      out.push_back(all_but(static_cast<Fp8Gemm>(__builtin_ctz(one.set))));
    } else {
      ASSIGN_OR_RETURN(Fp8GemmsPolicy p, ParseFp8GemmsPolicy(item));
      out.push_back(p);
    }
  }
  if (out.empty()) out.push_back(Fp8GemmsPolicy{});
  return out;
}

LayerConfig PresetConfig(const Preset& p, DType compute_dtype) {
  LayerConfig c;
  if (compute_dtype == DType::kFloat8E4M3) {
    c.fp8_recipe = current_fp8_recipe;
    c.fp8_gemms = current_fp8_gemms;
  }
  c.hidden = p.hidden, c.ffn = p.ffn, c.num_experts = p.experts, c.top_k = p.top_k;
  c.compute_dtype = compute_dtype;
  c.init_seed = 1;
  if (p.sigmoid_grouped) {
    c.score_function = ScoreFunction::kSigmoid, c.num_groups = 8, c.group_topk = 4;
  }
  return c;
}

absl::StatusOr<std::string> RunConfig(const Preset& p, DType compute_dtype) {
  const int rank = absl::GetFlag(FLAGS_rank), size = absl::GetFlag(FLAGS_size);
  const int device = absl::GetFlag(FLAGS_device) >= 0 ? absl::GetFlag(FLAGS_device) : rank;
  const LayerConfig c = PresetConfig(p, compute_dtype);
  const int64_t T = absl::GetFlag(FLAGS_tokens) > 0 ? absl::GetFlag(FLAGS_tokens) : p.tokens;

  Progress(absl::StrCat(p.name, " ", ComputeDTypeName(compute_dtype), ": start"));
  // The engine flags (server/engine_flags.h: --gemm_streams, --cublaslt_tuned, ...), as a
  // moe-worker takes them.
  const EngineOptions engine = EngineOptionsFromFlags();
  RETURN_IF_ERROR(CheckEngineOptions(engine));
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> cuda, MakeCudaBackend(device, engine.cuda));
  std::shared_ptr<KeyValueStore> store;
  if (size > 1) {
    ASSIGN_OR_RETURN(store, FileKeyValueStore::Create(absl::GetFlag(FLAGS_store_dir)));
  } else {
    store = std::make_shared<MemoryKeyValueStore>();
  }
  CommOptions options;
  options.timeout = absl::Seconds(300);
  ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nccl,
                   MakeNcclCommunicator(store, absl::StrCat("bench/", p.name), rank, size, device,
                                        cuda->stream(), options));
  Progress(absl::StrCat(p.name, ": communicator ready"));
  bench::TimingBackend tb(cuda.get());
  bench::TimingCommunicator tc(nccl.get(), cuda->stream());
  const double t_init = NowMs();
  ASSIGN_OR_RETURN(std::unique_ptr<MoeLayer> layer,
                   MoeLayer::Create(c, &tb, &tc, /*cancelled=*/nullptr, engine.layer));
  RETURN_IF_ERROR(cuda->Synchronize());
  const double init_s = (NowMs() - t_init) / 1000;
  const size_t weights_bytes = cuda->allocated_bytes();
  Progress(absl::StrCat(p.name, ": layer created in ", init_s, " s"));

  Tensor x = RandomBf16(T, p.hidden, 11 + rank), d_out = RandomBf16(T, p.hidden, 23 + rank);
  cudaHostRegister(x.raw(), x.num_bytes(), cudaHostRegisterDefault);
  cudaHostRegister(d_out.raw(), d_out.num_bytes(), cudaHostRegisterDefault);
  StepTimer timer(layer.get(), &tb, &tc, &x, &d_out, size);
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    RETURN_IF_ERROR(timer.Step(true));
    timer.ResetLogs();
  }
  ASSIGN_OR_RETURN(const std::string fingerprint, timer.Fingerprint());
  RETURN_IF_ERROR(layer->ZeroGradients());
  Progress(absl::StrCat(p.name, ": warm, fingerprint ", fingerprint));

  const int iters = absl::GetFlag(FLAGS_iters);
  const bool zero = absl::GetFlag(FLAGS_zero_grads);
  const int accum_iters = zero ? absl::GetFlag(FLAGS_accumulating_iters) : 0;
  Series series[3];  // forward, forward+backward, accumulating forward+backward
  std::map<std::string, double> breakdown, accum_breakdown;
  RETURN_IF_ERROR(timer.Time(false, false, iters, &series[0], nullptr));
  RETURN_IF_ERROR(timer.Time(true, zero, iters, &series[1], &breakdown));
  if (accum_iters > 0) {
    RETURN_IF_ERROR(timer.Time(true, false, accum_iters, &series[2], &accum_breakdown));
  }
  Progress(absl::StrCat(p.name, ": timed"));
  const double ffn_flops = 2.0 * T * p.top_k * p.hidden * 3.0 * p.ffn;
  const double fwd_dev = Median(series[0].device), fb_dev = Median(series[1].device);
  std::vector<std::pair<std::string, std::string>> kv = {
      {"bench", Str("gpu_bench")},
      {"config", Str(p.name)},
      {"device", Str(cuda->name())},
      {"rank", Num(rank)},
      {"size", Num(size)},
      {"tokens", Num(T)},
      {"dtype", Str("BF16")},  // x, out, d_out and d_x
      {"compute_dtype", Str(ComputeDTypeName(compute_dtype))},
      {"fp8_recipe", Str(compute_dtype == DType::kFloat8E4M3 ? Fp8RecipeName(c.fp8_recipe) : "")},
      // The policy asked for, and the GEMMs that ran FP8 (MoeLayer::fp8_gemms).
      {"fp8_gemms", Str(compute_dtype == DType::kFloat8E4M3 ? Fp8GemmsPolicyName(c.fp8_gemms)
                                                            : "")},
      {"fp8_gemms_run", Str(compute_dtype == DType::kFloat8E4M3
                                ? Fp8GemmSetName(layer->fp8_gemms())
                                : "")},
      {"zero_grads", zero ? "true" : "false"},
      {"fingerprint", Str(fingerprint)},
      {"init_s", Num(init_s)},
      {"fwd_ms", Num(Median(series[0].api))},
      {"fwd_device_ms", Num(fwd_dev)},
      {"fwdbwd_ms", Num(Median(series[1].api))},
      {"fwdbwd_device_ms", Num(fb_dev)},
      {"fwd_tflops_device", Num(ffn_flops / fwd_dev / 1e9)},
      {"fwdbwd_tflops_device", Num(3 * ffn_flops / fb_dev / 1e9)},
      {"fwd_span_ms", Num(Median(series[0].span))},
      {"fwdbwd_span_ms", Num(Median(series[1].span))},
      {"fwd_copy_ms", Num(Median(series[0].copy))},
      {"fwdbwd_copy_ms", Num(Median(series[1].copy))},
      {"fwd_device_ms_all", List(series[0].device)},
      {"fwdbwd_device_ms_all", List(series[1].device)},
      {"breakdown_fwdbwd_ms", BreakdownJson(breakdown, iters)},
      {"weights_bytes", Num(weights_bytes)},
      {"peak_bytes", Num(cuda->peak_allocated_bytes())},
      {"tuned_gemm_plans", Num(static_cast<double>(cuda::TunedGemmPlansAdopted()))},
      {"tuned_gemm_refused", Num(static_cast<double>(cuda::TunedGemmPlansRefused()))},
      {"fwd_ms_all", List(series[0].api)},
      {"fwdbwd_ms_all", List(series[1].api)},
  };
  if (zero) {
    kv.push_back({"zero_grads_host_ms", Num(Median(series[1].zero_host))});
    kv.push_back({"zero_grads_device_ms", Num(Median(series[1].zero_device))});
  } else {
    double sum = series[1].flush_device;
    for (double ms : series[1].device) sum += ms;
    kv.push_back({"fwdbwd_flush_device_ms", Num(series[1].flush_device)});
    kv.push_back({"fwdbwd_mean_device_ms", Num(sum / iters)});
  }
  if (accum_iters > 0) {
    const double acc_dev = Median(series[2].device);
    kv.push_back({"fwdbwd_accum_device_ms", Num(acc_dev)});
    double sum = series[2].flush_device;
    for (double ms : series[2].device) sum += ms;
    kv.push_back({"fwdbwd_accum_flush_device_ms", Num(series[2].flush_device)});
    kv.push_back({"fwdbwd_accum_mean_device_ms", Num(sum / accum_iters)});
    kv.push_back({"fwdbwd_accum_tflops_device", Num(3 * ffn_flops / acc_dev / 1e9)});
    kv.push_back({"fwdbwd_accum_device_ms_all", List(series[2].device)});
    kv.push_back({"breakdown_fwdbwd_accum_ms", BreakdownJson(accum_breakdown, accum_iters)});
  }
  if (size > 1) RETURN_IF_ERROR(AddExchangeFields(p, T, cuda.get(), nccl.get(), series, &kv));
  cudaHostUnregister(x.raw());
  cudaHostUnregister(d_out.raw());
  layer.reset();
  return Json(kv);
}

absl::Status Main() {
  std::vector<DType> dtypes;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_compute_dtypes), ',')) {
    ASSIGN_OR_RETURN(DType d, ParseComputeDType(absl::AsciiStrToUpper(name)));
    dtypes.push_back(d);
  }
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_configs), ',')) {
    const Preset* preset = FindBenchPreset(name);
    if (preset == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown config '", name, "'"));
    }
    // Each dtype right after the other for one preset: the same machine state for both.
    struct Run {
      DType dtype;
      Fp8Recipe recipe;
      Fp8GemmsPolicy gemms;
    };
    std::vector<Run> runs;
    ASSIGN_OR_RETURN(const std::vector<Fp8GemmsPolicy> policies,
                     ParseFp8GemmsFlag(absl::GetFlag(FLAGS_fp8_gemms)));
    for (DType dtype : dtypes) {
      if (dtype != DType::kFloat8E4M3) {
        runs.push_back({dtype, Fp8Recipe::kDelayed, Fp8GemmsPolicy{}});
        continue;
      }
      for (absl::string_view r : absl::StrSplit(absl::GetFlag(FLAGS_fp8_recipes), ',')) {
        ASSIGN_OR_RETURN(Fp8Recipe recipe, ParseFp8Recipe(absl::AsciiStrToUpper(r)));
        for (const Fp8GemmsPolicy& gemms : policies) runs.push_back({dtype, recipe, gemms});
      }
    }
    for (const auto& [dtype, recipe, gemms] : runs) {
      current_fp8_recipe = recipe;
      current_fp8_gemms = gemms;
      auto line = RunConfig(*preset, dtype);
      if (!line.ok()) {
        return absl::Status(line.status().code(),
                            absl::StrCat(preset->name, " ", ComputeDTypeName(dtype), ": ",
                                         line.status().message()));
      }
      std::printf("%s\n", line->c_str());
      std::fflush(stdout);
      if (!absl::GetFlag(FLAGS_json).empty()) {
        std::ofstream(absl::GetFlag(FLAGS_json), std::ios::app) << *line << "\n";
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Keep freed host memory in the process: the layer's API returns fresh host tensors every
  // step, and returning their pages to the kernel (glibc's default for large blocks) makes
  // every step fault them in again (slow in the GPU machine's VM).
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);
  absl::Status s = moe::Main();
  if (!s.ok()) {
    std::fprintf(stderr, "gpu_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
