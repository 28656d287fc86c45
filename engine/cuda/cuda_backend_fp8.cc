// CudaBackend's FP8 entry points (docs/SPEC.md "FP8"): whether this device can run
// compute_dtype = FP8, and the quantise launcher behind Backend::QuantizeFp8. The FP8 GEMMs
// themselves go through CublasLtGemm (cublaslt_gemm.cc) like every other GEMM.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_backend_impl.h"
#include "engine/cuda/cuda_status.h"
#include "engine/cuda/fp8_gemm_table.h"
#include "engine/fp8.h"
#include "engine/status_macros.h"

namespace moe {
namespace cuda {

absl::Status CudaBackend::CheckComputeDType(const LayerConfig& config) const {
  if (config.compute_dtype != DType::kFloat8E4M3) return absl::OkStatus();
  RETURN_IF_ERROR(Activate());
  int major = 0, minor = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_));
  if (major * 10 + minor < 89) {
    return absl::FailedPreconditionError(absl::StrCat(
        "compute_dtype FP8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); ",
        name(), " is sm_", major, minor, ". Use BF16 on this device"));
  }
  // cuBLASLt's FP8 kernels need 16-byte aligned operands and leading dimensions: k is H, F
  // or 2F, each a leading dimension of one-byte codes.
  if (config.hidden % 16 != 0 || config.ffn % 16 != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "compute_dtype FP8 on CUDA needs hidden and ffn to be multiples of 16 (got hidden=",
        config.hidden, ", ffn=", config.ffn, ")"));
  }
  return absl::OkStatus();
}

bool CudaBackend::Fp8GemmPays(const Fp8GemmShape& shape) const {
  if (!fp8_gemm_table_) return true;
  return FindFp8GemmChoice(shape).value_or(true);
}

absl::Status CudaBackend::QuantizeFp8(const QuantizeArgs& q) {
  RETURN_IF_ERROR(CheckQuantizeArgs(q));  // engine/backend.h
  if (q.batch > 65535) return absl::InvalidArgumentError("QuantizeFp8: batch above 65535");
  if (q.batch == 0) return absl::OkStatus();
  if (q.dst_grouped_t != nullptr) return QuantizeFp8Grouped(q);
  RETURN_IF_ERROR(Activate());
  ASSIGN_OR_RETURN(void* scratch, ScratchAlloc(QuantizeScratchBytes(q.batch)));
  const int err = LaunchQuantizeFp8(
      q.src, ToKType(q.src_type), q.batch, q.rows, q.cols, q.transpose,
      q.fp8 == DType::kFloat8E4M3 ? Fp8Kind::kE4M3 : Fp8Kind::kE5M2, static_cast<uint8_t*>(q.dst),
      q.scale, q.scale_stride, q.amax, q.amax_out, scratch, stream_);
  RETURN_IF_ERROR(ScratchFree(scratch));
  CUDA_RETURN_IF_ERROR(err);
  return absl::OkStatus();
}

absl::Status CudaBackend::QuantizeFp8Grouped(const QuantizeArgs& q) {
  if (q.cols > int64_t{65535} * 32) {
    return absl::InvalidArgumentError("QuantizeFp8: dst_grouped_t needs cols <= 65535 * 32");
  }
  RETURN_IF_ERROR(Activate());
  ASSIGN_OR_RETURN(void* scratch, ScratchAlloc(QuantizeScratchBytes(1)));
  const int err =
      LaunchQuantizeFp8Grouped(q.src, ToKType(q.src_type), q.rows, q.cols, q.group_rows.data(),
                               static_cast<int64_t>(q.group_rows.size()),
                               q.fp8 == DType::kFloat8E4M3 ? Fp8Kind::kE4M3 : Fp8Kind::kE5M2,
                               static_cast<uint8_t*>(q.dst), static_cast<uint8_t*>(q.dst_grouped_t),
                               Fp8GroupedColumns(q.group_rows), q.scale, q.amax, q.amax_out,
                               scratch, stream_);
  RETURN_IF_ERROR(ScratchFree(scratch));
  CUDA_RETURN_IF_ERROR(err);
  return absl::OkStatus();
}

absl::Status CudaBackend::Fp8HistoryAmax(const Fp8HistoryArgs& h) {
  RETURN_IF_ERROR(CheckFp8HistoryArgs(h));  // engine/backend.h
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(LaunchFp8HistoryAmax(h.history, h.len, h.steps, h.margin, h.most_recent,
                                            h.amax, stream_));
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace moe
