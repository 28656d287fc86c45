#include "tests/gpu/backend_pair.h"

#include <cstdlib>
#include <cstring>

#include "engine/cpu/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"

namespace moe {
namespace gpu_test {

BackendPair::BackendPair(const CudaBackendOptions& cuda_options) {
  cpu_ = MakeCpuBackend();
  auto gpu = MakeCudaBackend(0, cuda_options);
  if (!gpu.ok()) {
    error_ = gpu.status().ToString();
    return;
  }
  gpu_ = std::move(gpu).value();
}

Mirrored BackendPair::Upload(const void* data, size_t bytes) {
  Mirrored m;
  if (bytes == 0) return m;
  m.cpu = cpu_->Allocate(bytes).value();
  m.gpu = gpu_->Allocate(bytes).value();
  std::vector<uint8_t> poison;
  if (data == nullptr) {
    poison.assign(bytes, 0xAB);
    data = poison.data();
  }
  if (!cpu_->CopyFromHost(m.cpu.data(), data, bytes).ok() ||
      !gpu_->CopyFromHost(m.gpu.data(), data, bytes).ok()) {
    std::abort();  // test setup failure: nothing sensible to compare
  }
  return m;
}

void BackendPair::Fetch(const Mirrored& m, void* cpu_out, void* gpu_out, size_t bytes) {
  if (bytes == 0) return;
  if (!cpu_->CopyToHost(cpu_out, m.cpu.data(), bytes).ok() ||
      !gpu_->CopyToHost(gpu_out, m.gpu.data(), bytes).ok()) {
    std::abort();
  }
}

Results<float> BackendPair::DownloadBf16(const Mirrored& m, size_t count) {
  Results<uint16_t> raw = Download<uint16_t>(m, count);
  return Results<float>{Bf16ToFloats(raw.cpu), Bf16ToFloats(raw.gpu)};
}

}  // namespace gpu_test
}  // namespace moe
