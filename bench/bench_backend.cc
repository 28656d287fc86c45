// Backends of the engine benchmark. To add the CUDA backend: parse "cuda:N" below and return
// MakeCudaBackend(N) (engine/cuda/cuda_backend.h), and return a size-1 NCCL communicator from
// MakeBenchCommunicator for device memory (the local one is host-only); add the deps in BUILD.
#include "bench/bench_backend.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/comm/local_communicator.h"
#include "engine/cpu/cpu_backend.h"

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
  return absl::UnimplementedError(
      absl::StrCat("--device=", device, ": this benchmark has no such backend (have: cpu, cpu:N)"));
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeBenchCommunicator(const Backend& backend) {
  if (backend.memory_space() != MemorySpace::kHost) {
    return absl::UnimplementedError(
        absl::StrCat("no single-rank communicator for backend ", backend.name()));
  }
  return MakeLocalCommunicator(MemorySpace::kHost);
}

}  // namespace moe
