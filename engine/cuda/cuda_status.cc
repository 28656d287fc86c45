#include "engine/cuda/cuda_status.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace moe {
namespace cuda {

absl::Status CudaStatus(int err, const char* expr, const char* file, int line) {
  const cudaError_t e = static_cast<cudaError_t>(err);
  const std::string message =
      absl::StrCat("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in ", expr,
                   " at ", file, ":", line);
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
      return absl::InvalidArgumentError(message);
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CublasStatus(int status, const char* expr, const char* file, int line) {
  const cublasStatus_t s = static_cast<cublasStatus_t>(status);
  const std::string message =
      absl::StrCat("cuBLASLt error ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s),
                   ") in ", expr, " at ", file, ":", line);
  switch (s) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace cuda
}  // namespace moe
