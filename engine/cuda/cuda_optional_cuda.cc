// cuda_optional.h for builds with CUDA: forwards to the real backend and communicator.
#include "engine/comm/nccl_communicator.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_optional.h"

namespace moe {

bool CudaBuilt() { return true; }

int VisibleCudaDevices() { return CudaDeviceCount(); }

absl::StatusOr<std::unique_ptr<Backend>> MakeOptionalCudaBackend(int device) {
  return MakeCudaBackend(device);
}

absl::Status OptionalPinHostMemory(void* host, size_t bytes) { return PinHostMemory(host, bytes); }

absl::Status OptionalUnpinHostMemory(void* host) { return UnpinHostMemory(host); }

absl::StatusOr<std::unique_ptr<Communicator>> MakeOptionalNcclCommunicator(
    std::shared_ptr<KeyValueStore> store, const std::string& prefix, int rank, int size, int device,
    void* stream, const CommOptions& options) {
  return MakeNcclCommunicator(std::move(store), prefix, rank, size, device, stream, options);
}

}  // namespace moe
