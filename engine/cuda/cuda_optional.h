// The CUDA backend and NCCL communicator for code that must also build without CUDA (the
// server, the benchmarks' device switch): where the build machine has CUDA these forward to
// engine/cuda/cuda_backend.h and engine/comm/nccl_communicator.h; where it has not they
// return UNIMPLEMENTED and report no devices. Link //engine/cuda:cuda_optional.
//
//   if (VisibleCudaDevices() > 0) {
//     ASSIGN_OR_RETURN(std::unique_ptr<Backend> gpu, MakeOptionalCudaBackend(0));
//   }
#ifndef MOED_ENGINE_CUDA_CUDA_OPTIONAL_H_
#define MOED_ENGINE_CUDA_CUDA_OPTIONAL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/backend.h"
#include "engine/comm/communicator.h"
#include "engine/comm/kv_store.h"
#include "engine/cuda/cuda_backend_options.h"

namespace moe {

// Whether this binary was built with CUDA.
bool CudaBuilt();
// Visible CUDA devices (0 without CUDA, driver or GPU).
int VisibleCudaDevices();
// Total memory of CUDA device `device` in bytes; 0 without CUDA or when unknown.
int64_t OptionalCudaDeviceMemoryBytes(int device);
absl::StatusOr<std::unique_ptr<Backend>> MakeOptionalCudaBackend(
    int device, const CudaBackendOptions& options = {});
// See PinHostMemory / UnpinHostMemory in cuda_backend.h (UNIMPLEMENTED without CUDA).
absl::Status OptionalPinHostMemory(void* host, size_t bytes);
absl::Status OptionalUnpinHostMemory(void* host);
// See OpenCudaIpcHandle ... CopyMemory in cuda_backend.h (UNIMPLEMENTED without CUDA).
absl::StatusOr<void*> OptionalOpenCudaIpcHandle(absl::string_view handle, int device, size_t bytes);
absl::Status OptionalCloseCudaIpcHandle(void* device_ptr);
absl::StatusOr<void*> OptionalAllocateSharableDeviceMemory(int device, size_t bytes);
absl::Status OptionalFreeDeviceMemory(void* device_ptr);
absl::StatusOr<std::string> OptionalCudaIpcHandleOf(void* device_ptr);
absl::Status OptionalCopyMemory(void* dst, const void* src, size_t bytes);
// See MakeNcclCommunicator: `stream` is the backend's (Backend::stream()).
absl::StatusOr<std::unique_ptr<Communicator>> MakeOptionalNcclCommunicator(
    std::shared_ptr<KeyValueStore> store, const std::string& prefix, int rank, int size, int device,
    void* stream, const CommOptions& options);

}  // namespace moe

#endif  // MOED_ENGINE_CUDA_CUDA_OPTIONAL_H_
