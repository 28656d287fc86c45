// Check macros of the CUDA backend, one per foreign error domain (NCCL's checks.h style):
// a failing CUDA runtime or cuBLASLt call becomes an absl::Status naming the call, the
// library's message, file and line. Host code only.
//
//   CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, bytes, stream));
//   CUBLASLT_RETURN_IF_ERROR(cublasLtMatmul(...));
#ifndef MOED_ENGINE_CUDA_CUDA_STATUS_H_
#define MOED_ENGINE_CUDA_CUDA_STATUS_H_

#include "absl/status/status.h"

namespace moe {
namespace cuda {

// err: a cudaError_t (0 = success), e.g. from a kernels.cuh launcher.
absl::Status CudaStatus(int err, const char* expr, const char* file, int line);
// status: a cublasStatus_t (0 = success).
absl::Status CublasStatus(int status, const char* expr, const char* file, int line);

}  // namespace cuda
}  // namespace moe

#define CUDA_RETURN_IF_ERROR(expr)                                               \
  do {                                                                           \
    const int _moed_cuda_err = static_cast<int>(expr);                           \
    if (_moed_cuda_err != 0)                                                     \
      return ::moe::cuda::CudaStatus(_moed_cuda_err, #expr, __FILE__, __LINE__); \
  } while (0)

#define CUBLASLT_RETURN_IF_ERROR(expr)                                               \
  do {                                                                               \
    const int _moed_cublas_err = static_cast<int>(expr);                             \
    if (_moed_cublas_err != 0)                                                       \
      return ::moe::cuda::CublasStatus(_moed_cublas_err, #expr, __FILE__, __LINE__); \
  } while (0)

#endif  // MOED_ENGINE_CUDA_CUDA_STATUS_H_
