// The CUDA backend: engine/backend.h on one GPU.
//
// Memory comes from the device's stream-ordered pool (cudaMallocAsync, release threshold
// raised so freed blocks are reused instead of returned to the driver); every kernel, copy and
// GEMM runs on the backend's one non-blocking stream, except grouped GEMMs of small experts,
// which fan out over a few extra streams joined back by events. Only CopyToHost and Synchronize
// wait. GEMMs go through cuBLASLt (engine/cuda/cublaslt_gemm.h); kernels through the launcher
// API of engine/cuda/kernels.cuh. No CUDA type appears in this header.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Backend> gpu, MakeCudaBackend(/*device=*/0));
//   ASSIGN_OR_RETURN(Buffer x, gpu->Allocate(bytes));
#ifndef MOED_ENGINE_CUDA_CUDA_BACKEND_H_
#define MOED_ENGINE_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend_options.h"

namespace moe {

// A backend on CUDA device `device` (0-based). FAILED_PRECONDITION when no such device,
// INVALID_ARGUMENT for options out of range (CheckCudaBackendOptions).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device,
                                                         const CudaBackendOptions& options = {});

// Number of visible CUDA devices (0 when none or no driver).
int CudaDeviceCount();
// Total memory of CUDA device `device` in bytes (cudaGetDeviceProperties: no context is
// created and the calling thread's current device is left alone); 0 when it cannot be read.
int64_t CudaDeviceMemoryBytes(int device);

// Page-locks [host, host + bytes) for every device of the process (cudaHostRegister,
// portable), so copies from and to it run at PCIe speed without staging; for long-lived
// buffers such as a client's shared-memory region. UnpinHostMemory must be called with the same
// `host` before the memory is unmapped or freed.
absl::Status PinHostMemory(void* host, size_t bytes);
absl::Status UnpinHostMemory(void* host);

// CUDA IPC for clients' GPU regions (moe.v1 RegisterCudaSharedMemory). Opens `handle` (the
// bytes of a cudaIpcMemHandle_t from cudaIpcGetMemHandle in another process) on `device`:
// the allocation's device pointer in this process, until CloseCudaIpcHandle.
// FAILED_PRECONDITION when it cannot be opened or its allocation is shorter than `bytes`.
absl::StatusOr<void*> OpenCudaIpcHandle(absl::string_view handle, int device, size_t bytes);
absl::Status CloseCudaIpcHandle(void* device_ptr);
// The client's side (and tests): memory of `device` that can be shared (cudaMalloc), its
// handle, and a synchronous copy between any host or device pointers (cudaMemcpyDefault).
absl::StatusOr<void*> AllocateSharableDeviceMemory(int device, size_t bytes);
absl::Status FreeDeviceMemory(void* device_ptr);
absl::StatusOr<std::string> CudaIpcHandleOf(void* device_ptr);
absl::Status CopyMemory(void* dst, const void* src, size_t bytes);

}  // namespace moe

#endif  // MOED_ENGINE_CUDA_CUDA_BACKEND_H_
