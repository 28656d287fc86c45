// Private to the CUDA backend: large copies between pageable host memory and the device
// through pinned staging buffers, pipelined. A plain cudaMemcpy from or to pageable memory
// goes through the driver's own small staging at ~14 GB/s (measured on the H200 machine);
// here chunk i+1 moves over PCIe while several threads copy chunk i between the pinned buffer
// and the caller's memory, which is several times faster for the layer's inputs and outputs.
// Pinned (registered) host memory and device memory are not staged: callers check
// CopiesDirectly first.
//
//   HostStaging staging;
//   if (bytes >= HostStaging::kMinBytes && !HostStaging::CopiesDirectly(host)) {
//     RETURN_IF_ERROR(staging.ToHost(host, device_src, bytes, stream));
//   }
#ifndef MOED_ENGINE_CUDA_HOST_STAGING_H_
#define MOED_ENGINE_CUDA_HOST_STAGING_H_

#include <cstddef>

#include "absl/status/status.h"

namespace moe {
namespace cuda {

class HostStaging {
 public:
  static constexpr size_t kMinBytes = size_t{4} << 20;  // smaller copies go direct
  static constexpr size_t kChunkBytes = size_t{32} << 20;
  static constexpr int kSlots = 2;

  HostStaging() = default;
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Page-locked host memory, or device memory (a client's CUDA IPC region handed to the
  // engine as a tensor view): copies from and to it need no staging.
  static bool CopiesDirectly(const void* p);

  // Enqueues the copy on `stream` (cudaStream_t) after the work before it; returns when the
  // host buffer may be reused (its bytes are in pinned memory or already on the device).
  absl::Status ToDevice(void* device_dst, const void* host_src, size_t bytes, void* stream);
  // Returns when host_dst holds the bytes (and so all work enqueued before has finished).
  absl::Status ToHost(void* host_dst, const void* device_src, size_t bytes, void* stream);

 private:
  absl::Status Init();
  void* slot_[kSlots] = {};   // pinned host buffers of kChunkBytes
  void* event_[kSlots] = {};  // cudaEvent_t: the slot's last copy is done
};

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_HOST_STAGING_H_
