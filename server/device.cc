#include "server/device.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cuda/cuda_optional.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

// "cuda" (the GPU is picked by rank: rank % visible GPUs) or "cuda:N". -1 when not CUDA.
absl::StatusOr<int> CudaIndex(const std::string& device_flag, int rank) {
  if (device_flag == "cuda") {
    const int count = VisibleCudaDevices();
    if (count == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--device=cuda: no CUDA device visible", CudaBuilt() ? "" : " (built without CUDA)"));
    }
    return rank < 0 ? 0 : rank % count;
  }
  int index = -1;
  if (!absl::StartsWith(device_flag, "cuda:") || !absl::SimpleAtoi(device_flag.substr(5), &index) ||
      index < 0) {
    return -1;
  }
  if (index >= VisibleCudaDevices()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device=", device_flag, ": ", VisibleCudaDevices(),
                     " CUDA device(s) visible", CudaBuilt() ? "" : " (built without CUDA)"));
  }
  return index;
}

}  // namespace

absl::Status CheckDeviceFlag(const std::string& device_flag) {
  if (device_flag == "cpu") return absl::OkStatus();
  ASSIGN_OR_RETURN(int cuda, CudaIndex(device_flag, -1));
  if (cuda >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--device=", device_flag, ": unsupported device (known: \"cpu\", \"cuda\", \"cuda:N\")"));
}

int DefaultEmbeddedWorkers(const std::string& device_flag) {
  return device_flag == "cuda" ? VisibleCudaDevices() : 2;
}

std::string DeviceName(const std::string& device_flag, int rank) {
  if (device_flag != "cuda" || rank < 0) return device_flag;
  absl::StatusOr<int> index = CudaIndex(device_flag, rank);
  return index.ok() ? absl::StrCat("cuda:", *index) : device_flag;
}

int CudaOrdinal(const std::string& device_flag, int rank) {
  absl::StatusOr<int> index = CudaIndex(device_flag, rank);
  return index.ok() ? *index : -1;
}

int64_t DeviceMemoryCapacity(const std::string& device_flag, int rank) {
  const int cuda = CudaOrdinal(device_flag, rank);
  if (cuda >= 0) return OptionalCudaDeviceMemoryBytes(cuda);
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<int64_t>(pages) * page_size;
}

absl::StatusOr<WorkerDevice> MakeWorkerDevice(const std::string& device_flag,
                                              std::shared_ptr<KeyValueStore> store,
                                              const std::string& prefix, int rank, int size,
                                              const CommOptions& options,
                                              const EngineOptions& engine) {
  RETURN_IF_ERROR(CheckDeviceFlag(device_flag));
  WorkerDevice device;
  ASSIGN_OR_RETURN(const int cuda, CudaIndex(device_flag, rank));
  std::unique_ptr<Communicator> comm;
  if (cuda >= 0) {  // CUDA backend + NCCL; the unique id travels through `store`.
    ASSIGN_OR_RETURN(device.backend, MakeOptionalCudaBackend(cuda, engine.cuda));
    ASSIGN_OR_RETURN(comm, MakeOptionalNcclCommunicator(std::move(store), prefix, rank, size, cuda,
                                                        device.backend->stream(), options));
  } else {
    device.backend = MakeCpuBackend(engine.cpu_threads);
    ASSIGN_OR_RETURN(
        comm, MakeGlooCommunicator(std::move(store), prefix, rank, size, options, engine.gloo));
  }
  device.comm = std::make_unique<MeteredCommunicator>(std::move(comm));
  return device;
}

}  // namespace moe
