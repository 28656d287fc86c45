#include "engine/cuda/host_staging.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "engine/cuda/cuda_status.h"
#include "engine/status_macros.h"

namespace moe {
namespace cuda {
namespace {

// memcpy split over a few threads (one host thread reaches only ~10 GB/s).
void ParallelMemcpy(void* dst, const void* src, size_t bytes) {
  constexpr size_t kPerThread = size_t{4} << 20;
  const int threads = static_cast<int>(std::min<size_t>(8, (bytes + kPerThread - 1) / kPerThread));
  if (threads <= 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const size_t part = (bytes + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    const size_t begin = t * part, len = begin < bytes ? std::min(part, bytes - begin) : 0;
    if (len == 0) break;
    pool.emplace_back([=] {
      std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, len);
    });
  }
  std::memcpy(dst, src, std::min(part, bytes));
  for (std::thread& th : pool) th.join();
}

}  // namespace

HostStaging::~HostStaging() {
  for (int i = 0; i < kSlots; ++i) {
    if (event_[i] != nullptr) {
      cudaEventSynchronize(static_cast<cudaEvent_t>(event_[i]));
      cudaEventDestroy(static_cast<cudaEvent_t>(event_[i]));
    }
    if (slot_[i] != nullptr) cudaFreeHost(slot_[i]);
  }
}

bool HostStaging::CopiesDirectly(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost || attr.type == cudaMemoryTypeDevice ||
         attr.type == cudaMemoryTypeManaged;
}

absl::Status HostStaging::Init() {
  if (slot_[0] != nullptr) return absl::OkStatus();
  for (int i = 0; i < kSlots; ++i) {
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&slot_[i], kChunkBytes));
    cudaEvent_t e;
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    event_[i] = e;
  }
  return absl::OkStatus();
}

absl::Status HostStaging::ToDevice(void* device_dst, const void* host_src, size_t bytes,
                                   void* stream) {
  RETURN_IF_ERROR(Init());
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (size_t off = 0, i = 0; off < bytes; off += kChunkBytes, ++i) {
    const int k = static_cast<int>(i % kSlots);
    const size_t len = std::min(kChunkBytes, bytes - off);
    // The slot's previous upload must be done before it is overwritten.
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(static_cast<cudaEvent_t>(event_[k])));
    ParallelMemcpy(slot_[k], static_cast<const char*>(host_src) + off, len);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(device_dst) + off, slot_[k], len,
                                         cudaMemcpyHostToDevice, s));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(event_[k]), s));
  }
  return absl::OkStatus();
}

absl::Status HostStaging::ToHost(void* host_dst, const void* device_src, size_t bytes,
                                 void* stream) {
  RETURN_IF_ERROR(Init());
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  auto enqueue = [&](size_t i) -> absl::Status {
    const int k = static_cast<int>(i % kSlots);
    const size_t off = i * kChunkBytes, len = std::min(kChunkBytes, bytes - off);
    // A slot still being uploaded by ToDevice must finish first (host-side wait).
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(static_cast<cudaEvent_t>(event_[k])));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot_[k], static_cast<const char*>(device_src) + off, len,
                                         cudaMemcpyDeviceToHost, s));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(event_[k]), s));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(enqueue(0));
  for (size_t i = 0; i < chunks; ++i) {
    const int k = static_cast<int>(i % kSlots);
    const size_t off = i * kChunkBytes, len = std::min(kChunkBytes, bytes - off);
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(static_cast<cudaEvent_t>(event_[k])));
    // Chunk i is in its slot; start chunk i + 1 (into the other slot, free since chunk i - 1
    // was copied out) before copying chunk i out.
    if (i + 1 < chunks) RETURN_IF_ERROR(enqueue(i + 1));
    ParallelMemcpy(static_cast<char*>(host_dst) + off, slot_[k], len);
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace moe
