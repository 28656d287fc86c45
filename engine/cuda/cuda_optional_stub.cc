// cuda_optional.h for builds without CUDA: no devices, and UNIMPLEMENTED on use.
#include "engine/cuda/cuda_optional.h"

namespace moe {

bool CudaBuilt() { return false; }

int VisibleCudaDevices() { return 0; }

int64_t OptionalCudaDeviceMemoryBytes(int) { return 0; }

absl::StatusOr<std::unique_ptr<Backend>> MakeOptionalCudaBackend(int, const CudaBackendOptions&) {
  return absl::UnimplementedError("this binary was built without CUDA");
}

absl::Status OptionalPinHostMemory(void*, size_t) {
  return absl::UnimplementedError("this binary was built without CUDA");
}

absl::Status OptionalUnpinHostMemory(void*) {
  return absl::UnimplementedError("this binary was built without CUDA");
}

absl::StatusOr<void*> OptionalOpenCudaIpcHandle(absl::string_view, int, size_t) {
  return absl::UnimplementedError("this binary was built without CUDA (no CUDA IPC)");
}

absl::Status OptionalCloseCudaIpcHandle(void*) {
  return absl::UnimplementedError("this binary was built without CUDA (no CUDA IPC)");
}

absl::StatusOr<void*> OptionalAllocateSharableDeviceMemory(int, size_t) {
  return absl::UnimplementedError("this binary was built without CUDA");
}

absl::Status OptionalFreeDeviceMemory(void*) {
  return absl::UnimplementedError("this binary was built without CUDA");
}

absl::StatusOr<std::string> OptionalCudaIpcHandleOf(void*) {
  return absl::UnimplementedError("this binary was built without CUDA (no CUDA IPC)");
}

absl::Status OptionalCopyMemory(void*, const void*, size_t) {
  return absl::UnimplementedError("this binary was built without CUDA");
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeOptionalNcclCommunicator(
    std::shared_ptr<KeyValueStore>, const std::string&, int, int, int, void*, const CommOptions&) {
  return absl::UnimplementedError("this binary was built without CUDA (no NCCL)");
}

}  // namespace moe
