// engine_bench: times one MoE layer (engine/moe_layer.h) on one device, forward and
// forward+backward, and prints one JSON object on stdout.
//
//   bazel run //bench:engine_bench -- --config=te_seed --tokens=2048 --dtype=bf16 --device=cpu
//   bazel run //bench:engine_bench -- --tokens=512 --hidden=256 --ffn=512 --experts=8 --top_k=2
//
// A preset (--config) gives the shapes of docs/SPEC.md "Reference test shapes"; any explicit flag
// overrides its field. FLOP counts are the nominal expert-FFN work, 2*T*k*H*up + 2*T*k*F*H per
// forward (up = 2F gated, F plain; 2*T*k*H*3F for gated), three times that for forward +
// backward; the router, permutation and combine are timed but not counted.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_backend.h"
#include "bench/presets.h"
#include "engine/config.h"
#include "engine/moe_layer.h"
#include "engine/status_macros.h"
#include "engine/tensor.h"

ABSL_FLAG(std::string, config, "", "preset: te_seed, mixtral, dsv3, qwen3 (flags override it)");
ABSL_FLAG(int64_t, tokens, -1, "T, tokens per step");
ABSL_FLAG(int64_t, hidden, -1, "H");
ABSL_FLAG(int64_t, ffn, -1, "F, each expert's FFN width");
ABSL_FLAG(int64_t, experts, -1, "E");
ABSL_FLAG(int64_t, top_k, -1, "k");
ABSL_FLAG(std::string, score_function, "", "softmax or sigmoid");
ABSL_FLAG(std::string, pre_softmax, "", "true or false");
ABSL_FLAG(int64_t, num_groups, -1, "grouped top-k: number of groups (0 = off)");
ABSL_FLAG(int64_t, group_topk, -1, "grouped top-k: groups kept (0 = off)");
ABSL_FLAG(std::string, use_expert_bias, "", "true or false (sigmoid only)");
ABSL_FLAG(double, capacity_factor, -1, "0 = dropless");
ABSL_FLAG(int64_t, align_size, -1, "pad each expert's rows to a multiple (0 = off)");
ABSL_FLAG(double, aux_loss_coeff, -1, "aux loss coefficient (0 = off)");
ABSL_FLAG(double, z_loss_coeff, -1, "z-loss coefficient (0 = off)");
ABSL_FLAG(std::string, activation, "", "silu, gelu, relu or linear");
ABSL_FLAG(std::string, gated, "", "true or false");
ABSL_FLAG(std::string, use_bias, "", "true or false");
ABSL_FLAG(std::string, dtype, "bf16", "bf16 or fp32 (activations and compute)");
ABSL_FLAG(std::string, device, "cpu", "cpu, cpu:THREADS (see bench/bench_backend.h)");
ABSL_FLAG(int, warmup, 2, "untimed forward+backward steps first");
ABSL_FLAG(int, iters, 10, "timed steps of each kind");
ABSL_FLAG(bool, backward, true, "also time forward+backward");
ABSL_FLAG(uint64_t, seed, 1, "init seed and input seed");

namespace moe {
namespace {

absl::Status ParseBool(const std::string& flag, const std::string& value, bool* out) {
  if (value.empty()) return absl::OkStatus();
  if (value == "true" || value == "1") {
    *out = true;
  } else if (value == "false" || value == "0") {
    *out = false;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": not true/false"));
  }
  return absl::OkStatus();
}

// The layer config and token count from --config and the explicit flags.
absl::Status BuildConfig(LayerConfig* c, int64_t* tokens) {
  const std::string preset = absl::GetFlag(FLAGS_config);
  *tokens = 0;
  if (!preset.empty()) {
    const BenchPreset* p = FindBenchPreset(preset);
    if (p == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--config=", preset, ": unknown (te_seed, mixtral, dsv3, qwen3)"));
    }
    *tokens = p->tokens;
    c->hidden = p->hidden;
    c->ffn = p->ffn;
    c->num_experts = p->experts;
    c->top_k = p->top_k;
    if (p->sigmoid_grouped) {
      c->score_function = ScoreFunction::kSigmoid;
      c->num_groups = 8;
      c->group_topk = 4;
    }
  }
  auto set = [](int64_t flag, int64_t* field) {
    if (flag >= 0) *field = flag;
  };
  set(absl::GetFlag(FLAGS_tokens), tokens);
  set(absl::GetFlag(FLAGS_hidden), &c->hidden);
  set(absl::GetFlag(FLAGS_ffn), &c->ffn);
  set(absl::GetFlag(FLAGS_experts), &c->num_experts);
  set(absl::GetFlag(FLAGS_top_k), &c->top_k);
  set(absl::GetFlag(FLAGS_num_groups), &c->num_groups);
  set(absl::GetFlag(FLAGS_group_topk), &c->group_topk);
  set(absl::GetFlag(FLAGS_align_size), &c->align_size);
  if (absl::GetFlag(FLAGS_capacity_factor) >= 0) {
    c->capacity_factor = absl::GetFlag(FLAGS_capacity_factor);
  }
  if (absl::GetFlag(FLAGS_aux_loss_coeff) >= 0) {
    c->aux_loss_coeff = absl::GetFlag(FLAGS_aux_loss_coeff);
  }
  if (absl::GetFlag(FLAGS_z_loss_coeff) >= 0) c->z_loss_coeff = absl::GetFlag(FLAGS_z_loss_coeff);
  if (!absl::GetFlag(FLAGS_score_function).empty()) {
    ASSIGN_OR_RETURN(c->score_function, ParseScoreFunction(absl::GetFlag(FLAGS_score_function)));
  }
  if (!absl::GetFlag(FLAGS_activation).empty()) {
    ASSIGN_OR_RETURN(c->activation, ParseActivation(absl::GetFlag(FLAGS_activation)));
  }
  RETURN_IF_ERROR(ParseBool("pre_softmax", absl::GetFlag(FLAGS_pre_softmax), &c->pre_softmax));
  RETURN_IF_ERROR(ParseBool("gated", absl::GetFlag(FLAGS_gated), &c->gated));
  RETURN_IF_ERROR(ParseBool("use_bias", absl::GetFlag(FLAGS_use_bias), &c->use_bias));
  RETURN_IF_ERROR(
      ParseBool("use_expert_bias", absl::GetFlag(FLAGS_use_expert_bias), &c->use_expert_bias));
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "bf16") {
    c->compute_dtype = DType::kBFloat16;
  } else if (dtype == "fp32") {
    c->compute_dtype = DType::kFloat32;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--dtype=", dtype, ": bf16 or fp32"));
  }
  c->init_seed = absl::GetFlag(FLAGS_seed);
  if (*tokens < 0 || (preset.empty() && absl::GetFlag(FLAGS_tokens) < 0)) {
    return absl::InvalidArgumentError("--tokens (or --config) is required");
  }
  if (absl::GetFlag(FLAGS_iters) < 1 || absl::GetFlag(FLAGS_warmup) < 0) {
    return absl::InvalidArgumentError("--iters must be >= 1 and --warmup >= 0");
  }
  return ValidateConfig(*c, /*ep_ranks=*/1);
}

Tensor RandomTensor(int64_t rows, int64_t cols, uint64_t seed, DType dtype) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tensor t = Tensor::Zeros(DType::kFloat32, {rows, cols});
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = dist(rng);
  return t.ConvertTo(dtype);
}

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Linear-interpolated quantile of sorted values.
double Quantile(const std::vector<double>& sorted, double q) {
  const double pos = q * (sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (pos - lo) * (sorted[hi] - sorted[lo]);
}

std::string Timings(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return absl::StrFormat(R"({"median": %.3f, "p10": %.3f, "p90": %.3f, "min": %.3f, "n": %d})",
                         Quantile(ms, 0.5), Quantile(ms, 0.1), Quantile(ms, 0.9), ms.front(),
                         ms.size());
}

absl::Status Run() {
  LayerConfig config;
  int64_t tokens = 0;
  RETURN_IF_ERROR(BuildConfig(&config, &tokens));
  const std::string device = absl::GetFlag(FLAGS_device);
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, MakeBenchBackend(device));
  ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, MakeBenchCommunicator(*backend));
  const double init_start = NowMs();
  ASSIGN_OR_RETURN(std::unique_ptr<MoeLayer> layer,
                   MoeLayer::Create(config, backend.get(), comm.get()));
  const double init_ms = NowMs() - init_start;

  const DType dtype = config.compute_dtype;
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const Tensor x = RandomTensor(tokens, config.hidden, seed + 1, dtype);
  const Tensor d_out = RandomTensor(tokens, config.hidden, seed + 2, dtype);
  size_t context_bytes = 0;
  auto forward_backward = [&]() -> absl::Status {
    std::unique_ptr<StepContext> saved;
    ASSIGN_OR_RETURN(ForwardResult fwd, layer->Forward(x, &saved));
    context_bytes = saved->bytes();
    ASSIGN_OR_RETURN(Tensor d_x, layer->Backward(*saved, d_out, 1.0, 1.0));
    return backend->Synchronize();
  };
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) RETURN_IF_ERROR(forward_backward());

  std::vector<double> fwd_ms, fwd_bwd_ms;
  for (int i = 0; i < absl::GetFlag(FLAGS_iters); ++i) {
    const double start = NowMs();
    ASSIGN_OR_RETURN(ForwardResult fwd, layer->Forward(x, nullptr));
    RETURN_IF_ERROR(backend->Synchronize());
    fwd_ms.push_back(NowMs() - start);
  }
  if (absl::GetFlag(FLAGS_backward)) {
    for (int i = 0; i < absl::GetFlag(FLAGS_iters); ++i) {
      const double start = NowMs();
      RETURN_IF_ERROR(forward_backward());
      fwd_bwd_ms.push_back(NowMs() - start);
      RETURN_IF_ERROR(layer->ZeroGradients());  // untimed: keeps gradients bounded
    }
  }

  const double T = static_cast<double>(tokens), k = static_cast<double>(config.top_k);
  const double H = static_cast<double>(config.hidden), F = static_cast<double>(config.ffn);
  const double flops_fwd =
      2.0 * T * k * H * static_cast<double>(UpWidth(config)) + 2.0 * T * k * F * H;
  std::vector<double> sorted_fwd = fwd_ms;
  std::sort(sorted_fwd.begin(), sorted_fwd.end());
  const double tflops_fwd = flops_fwd / (Quantile(sorted_fwd, 0.5) * 1e-3) / 1e12;

  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));

  std::string json = "{\n";
  absl::StrAppendFormat(&json, "  \"benchmark\": \"engine\",\n  \"preset\": \"%s\",\n",
                        absl::GetFlag(FLAGS_config));
  absl::StrAppendFormat(&json,
                        "  \"shape\": {\"tokens\": %d, \"hidden\": %d, \"ffn\": %d, "
                        "\"experts\": %d, \"top_k\": %d},\n",
                        tokens, config.hidden, config.ffn, config.num_experts, config.top_k);
  absl::StrAppendFormat(&json, "  \"config\": \"%s\",\n", ConfigToString(config));
  absl::StrAppendFormat(&json, "  \"dtype\": \"%s\",\n  \"backend\": \"%s\",\n", DTypeName(dtype),
                        backend->name());
  absl::StrAppendFormat(&json, "  \"device_flag\": \"%s\",\n  \"host\": \"%s\",\n", device, host);
  absl::StrAppendFormat(&json, "  \"hardware_threads\": %d,\n  \"date\": \"%s\",\n",
                        std::thread::hardware_concurrency(), date);
  absl::StrAppendFormat(&json, "  \"warmup\": %d,\n  \"iters\": %d,\n  \"init_ms\": %.1f,\n",
                        absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_iters), init_ms);
  absl::StrAppendFormat(&json, "  \"forward_ms\": %s,\n", Timings(fwd_ms));
  if (!fwd_bwd_ms.empty()) {
    std::vector<double> sorted = fwd_bwd_ms;
    std::sort(sorted.begin(), sorted.end());
    absl::StrAppendFormat(&json, "  \"forward_backward_ms\": %s,\n", Timings(fwd_bwd_ms));
    absl::StrAppendFormat(&json, "  \"tflops_forward_backward\": %.4f,\n",
                          3.0 * flops_fwd / (Quantile(sorted, 0.5) * 1e-3) / 1e12);
  }
  absl::StrAppendFormat(&json, "  \"ffn_flops_forward\": %.6e,\n", flops_fwd);
  absl::StrAppendFormat(&json, "  \"tflops_forward\": %.4f,\n", tflops_fwd);
  absl::StrAppendFormat(&json, "  \"step_context_bytes\": %d,\n", context_bytes);
  absl::StrAppendFormat(&json, "  \"peak_backend_memory_bytes\": %d\n}\n",
                        backend->peak_allocated_bytes());
  std::fputs(json.c_str(), stdout);
  return absl::OkStatus();
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = moe::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "engine_bench: %s\n", status.ToString().c_str());
    return absl::IsInvalidArgument(status) || absl::IsUnimplemented(status) ? 2 : 1;
  }
  return 0;
}
