// cuda_optional.h for builds with CUDA: forwards to the real backend and communicator.
#include "engine/comm/nccl_communicator.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_optional.h"

namespace moe {

bool CudaBuilt() { return true; }

int VisibleCudaDevices() { return CudaDeviceCount(); }

int64_t OptionalCudaDeviceMemoryBytes(int device) { return CudaDeviceMemoryBytes(device); }

absl::StatusOr<std::unique_ptr<Backend>> MakeOptionalCudaBackend(
    int device, const CudaBackendOptions& options) {
  return MakeCudaBackend(device, options);
}

absl::Status OptionalPinHostMemory(void* host, size_t bytes) { return PinHostMemory(host, bytes); }

absl::Status OptionalUnpinHostMemory(void* host) { return UnpinHostMemory(host); }

absl::StatusOr<void*> OptionalOpenCudaIpcHandle(absl::string_view handle, int device,
                                                size_t bytes) {
  return OpenCudaIpcHandle(handle, device, bytes);
}

absl::Status OptionalCloseCudaIpcHandle(void* device_ptr) { return CloseCudaIpcHandle(device_ptr); }

absl::StatusOr<void*> OptionalAllocateSharableDeviceMemory(int device, size_t bytes) {
  return AllocateSharableDeviceMemory(device, bytes);
}

absl::Status OptionalFreeDeviceMemory(void* device_ptr) { return FreeDeviceMemory(device_ptr); }

absl::StatusOr<std::string> OptionalCudaIpcHandleOf(void* device_ptr) {
  return CudaIpcHandleOf(device_ptr);
}

absl::Status OptionalCopyMemory(void* dst, const void* src, size_t bytes) {
  return CopyMemory(dst, src, bytes);
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeOptionalNcclCommunicator(
    std::shared_ptr<KeyValueStore> store, const std::string& prefix, int rank, int size, int device,
    void* stream, const CommOptions& options) {
  return MakeNcclCommunicator(std::move(store), prefix, rank, size, device, stream, options);
}

}  // namespace moe
