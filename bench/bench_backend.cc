// Backends of the engine benchmark: "cpu", "cpu:N", and "cuda:N" (through
// engine/cuda/cuda_optional.h, so that this builds without CUDA too), whose single-rank
// communicator is NCCL with one rank (the local one is host-only).
#include "bench/bench_backend.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/comm/local_communicator.h"
#include "engine/comm/memory_kv_store.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cuda/cuda_optional.h"

namespace moe {

absl::StatusOr<std::unique_ptr<Backend>> MakeBenchBackend(const std::string& device) {
  if (device == "cpu") return MakeCpuBackend();
  if (absl::StartsWith(device, "cpu:")) {
    int threads = 0;
    if (!absl::SimpleAtoi(device.substr(4), &threads) || threads <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": bad thread count"));
    }
    return MakeCpuBackend(threads);
  }
  if (absl::StartsWith(device, "cuda:")) {
    int index = -1;
    if (!absl::SimpleAtoi(device.substr(5), &index) || index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": bad GPU index"));
    }
    return MakeOptionalCudaBackend(index);
  }
  return absl::UnimplementedError(absl::StrCat(
      "--device=", device, ": this benchmark has no such backend (have: cpu, cpu:N, cuda:N)"));
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeBenchCommunicator(const Backend& backend) {
  if (backend.memory_space() == MemorySpace::kDevice && backend.stream() != nullptr) {
    int device = 0;
    if (absl::StartsWith(backend.name(), "cuda:")) {
      (void)absl::SimpleAtoi(backend.name().substr(5), &device);
    }
    return MakeOptionalNcclCommunicator(std::make_shared<MemoryKeyValueStore>(), "bench", 0, 1,
                                        device, backend.stream(), CommOptions{});
  }
  if (backend.memory_space() != MemorySpace::kHost) {
    return absl::UnimplementedError(
        absl::StrCat("no single-rank communicator for backend ", backend.name()));
  }
  return MakeLocalCommunicator(MemorySpace::kHost);
}

}  // namespace moe
