// The engine's flags (server/engine_flags.h).
#include "server/engine_flags.h"

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "engine/config.h"

ABSL_FLAG(double, deferred_wgrad_fraction, moe::kDefaultDeferredWgradFraction,
          "the memory a layer may keep for deferred expert weight gradients, as a fraction of "
          "a worker's wi + wo gradient bytes (docs/SPEC.md \"Weight gradients of several "
          "backwards\"); 0 turns deferral off");
ABSL_FLAG(std::string, gloo_iface, "",
          "cpu device: the network interface Gloo listens on (e.g. eth0); empty: "
          "--gloo_hostname");
ABSL_FLAG(std::string, gloo_hostname, "",
          "cpu device: the name or address Gloo listens on; with --gloo_iface also empty, the "
          "worker's --advertise_host");
ABSL_FLAG(bool, cuda_host_staging, moe::CudaBackendOptions().host_staging,
          "cuda device: pinned, pipelined staging of large pageable host copies");
ABSL_FLAG(int, gemm_streams, moe::CudaBackendOptions().gemm_streams,
          "cuda device: side streams GroupedGemm spreads its GEMMs over (1 to 16)");
ABSL_FLAG(int64_t, gemm_serial_gflops, moe::CudaBackendOptions().gemm_serial_gflops,
          "cuda device: GroupedGemm runs its GEMMs one at a time when their mean size exceeds "
          "this many GFLOP (0: never)");
ABSL_FLAG(bool, fp32_gemm_bf16x3, moe::CudaBackendOptions().fp32_gemm_bf16x3,
          "cuda device: the router's fp32 GEMMs on bf16 tensor cores (false: fp32 FMA, other "
          "rounding)");
ABSL_FLAG(bool, cublaslt_tuned, moe::CudaBackendOptions().cublaslt_tuned,
          "cuda device: the measured GEMM configurations of engine/cuda/cublaslt_plans.cc "
          "(false: cuBLASLt's heuristic everywhere, bitwise the same results)");
ABSL_FLAG(bool, cublaslt_log, moe::CudaBackendOptions().cublaslt_log,
          "cuda device: log the weight-gradient and tuned GEMM plans chosen");

namespace moe {
namespace {

constexpr const char* kEngineFlags[] = {
    "deferred_wgrad_fraction", "gloo_iface",     "gloo_hostname",
    "cuda_host_staging",       "gemm_streams",   "gemm_serial_gflops",
    "fp32_gemm_bf16x3",        "cublaslt_tuned", "cublaslt_log",
};

}  // namespace

EngineOptions EngineOptionsFromFlags() {
  EngineOptions e;
  e.layer.deferred_wgrad_fraction = absl::GetFlag(FLAGS_deferred_wgrad_fraction);
  e.gloo.iface = absl::GetFlag(FLAGS_gloo_iface);
  e.gloo.hostname = absl::GetFlag(FLAGS_gloo_hostname);
  CudaBackendOptions& c = e.cuda;
  c.host_staging = absl::GetFlag(FLAGS_cuda_host_staging);
  c.gemm_streams = absl::GetFlag(FLAGS_gemm_streams);
  c.gemm_serial_gflops = absl::GetFlag(FLAGS_gemm_serial_gflops);
  c.fp32_gemm_bf16x3 = absl::GetFlag(FLAGS_fp32_gemm_bf16x3);
  c.cublaslt_tuned = absl::GetFlag(FLAGS_cublaslt_tuned);
  c.cublaslt_log = absl::GetFlag(FLAGS_cublaslt_log);
  // cublaslt_workspace_mb and the weight-gradient algorithm indices stay at their defaults: no
  // flag (measured 2026-12-01 on dsv3: cuBLASLt offers one candidate per weight-gradient shape,
  // so they change nothing; the fields remain for experiments in code).
  return e;
}

absl::Status CheckEngineOptions(const EngineOptions& engine) {
  for (const absl::Status& s : {CheckDeferredWgradFraction(engine.layer.deferred_wgrad_fraction),
                                CheckCudaBackendOptions(engine.cuda)}) {
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("--", s.message()));
  }
  return absl::OkStatus();
}

std::vector<std::string> EngineFlagsForChild() {
  std::vector<std::string> args;
  for (const char* name : kEngineFlags) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag != nullptr && flag->CurrentValue() != flag->DefaultValue()) {
      args.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
    }
  }
  return args;
}

}  // namespace moe
