// The CUDA backend's knobs, set by its creator (MakeCudaBackend, MakeOptionalCudaBackend). The
// defaults are the measured fastest; the others exist for comparisons and diagnosis on a GPU
// machine (moe-worker's and gpu_bench's flags, server/engine_flags.h; the workspace size and
// the weight-gradient algorithm indices have no flag: constants but for experiments in code).
// No CUDA type here: the server and the benchmarks include it also where CUDA is absent.
//
//   CudaBackendOptions options;
//   options.cublaslt_tuned = false;  // the heuristic's configuration for every GEMM
//   RETURN_IF_ERROR(CheckCudaBackendOptions(options));
//   ASSIGN_OR_RETURN(std::unique_ptr<Backend> gpu, MakeCudaBackend(0, options));
#ifndef MOED_ENGINE_CUDA_CUDA_BACKEND_OPTIONS_H_
#define MOED_ENGINE_CUDA_CUDA_BACKEND_OPTIONS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe {

struct CudaBackendOptions {
  static constexpr int kMaxGemmStreams = 16;
  static constexpr int kMaxAlgoIndex = 15;

  // Pinned, pipelined staging of large pageable host copies (engine/cuda/host_staging.h).
  // Opt-in: it made the layer's output copies ~1.5x faster on the H200 machine, but no full
  // EP=2 run has been made with it on since a heap corruption there was traced to NCCL's
  // watchdog (fixed).
  bool host_staging = false;
  // How many side streams GroupedGemm spreads its GEMMs over, 1 to kMaxGemmStreams.
  int gemm_streams = 4;
  // GroupedGemm runs its GEMMs one at a time on the main stream when their mean size exceeds
  // this many GFLOP; 0: never.
  int64_t gemm_serial_gflops = 0;
  // fp32 Gemms with GemmArgs::a_bf16 or a short k run on bf16 tensor cores (SplitFp32Gemm,
  // ShortKFp32Gemm); false: cuBLASLt's fp32 GEMM (other rounding).
  bool fp32_gemm_bf16x3 = true;
  // The expert GEMMs of shapes engine/cuda/cublaslt_plans.h lists take its measured
  // configuration where the device and cuBLASLt are those it was measured on; false: the
  // heuristic's first everywhere (bitwise the same results).
  bool cublaslt_tuned = true;
  // Log the weight-gradient and tuned plans chosen.
  bool cublaslt_log = false;
  // Each cuBLASLt workspace's size (one per side stream and one for the main stream), MiB,
  // 0 to 1024.
  int cublaslt_workspace_mb = 32;
  // CublasLtTuning::wgrad_algo_index, 0 to kMaxAlgoIndex.
  int cublaslt_wgrad_algo = 0;
  // CublasLtTuning::wgrad_accumulate_algo_index, 0 to kMaxAlgoIndex; -1: cublaslt_wgrad_algo.
  int cublaslt_wgrad_accum_algo = -1;
};

// INVALID_ARGUMENT naming the field at fault when a value is out of its range.
inline absl::Status CheckCudaBackendOptions(const CudaBackendOptions& o) {
  auto out_of_range = [](const char* name, int64_t v, int64_t lo, int64_t hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=", v, ": expected an integer in [", lo, ", ", hi, "]"));
  };
  if (o.gemm_streams < 1 || o.gemm_streams > CudaBackendOptions::kMaxGemmStreams) {
    return out_of_range("gemm_streams", o.gemm_streams, 1, CudaBackendOptions::kMaxGemmStreams);
  }
  if (o.gemm_serial_gflops < 0 || o.gemm_serial_gflops > (int64_t{1} << 30)) {
    return out_of_range("gemm_serial_gflops", o.gemm_serial_gflops, 0, int64_t{1} << 30);
  }
  if (o.cublaslt_workspace_mb < 0 || o.cublaslt_workspace_mb > 1024) {
    return out_of_range("cublaslt_workspace_mb", o.cublaslt_workspace_mb, 0, 1024);
  }
  if (o.cublaslt_wgrad_algo < 0 || o.cublaslt_wgrad_algo > CudaBackendOptions::kMaxAlgoIndex) {
    return out_of_range("cublaslt_wgrad_algo", o.cublaslt_wgrad_algo, 0,
                        CudaBackendOptions::kMaxAlgoIndex);
  }
  if (o.cublaslt_wgrad_accum_algo < -1 ||
      o.cublaslt_wgrad_accum_algo > CudaBackendOptions::kMaxAlgoIndex) {
    return out_of_range("cublaslt_wgrad_accum_algo", o.cublaslt_wgrad_accum_algo, -1,
                        CudaBackendOptions::kMaxAlgoIndex);
  }
  return absl::OkStatus();
}

}  // namespace moe

#endif  // MOED_ENGINE_CUDA_CUDA_BACKEND_OPTIONS_H_
