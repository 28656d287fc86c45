// A worker's mappings of client shared-memory regions (moe.v1 RegisterSystemSharedMemory and
// RegisterCudaSharedMemory):
// the engine reads its slice of a step's input straight from a region and writes its slice of
// the output straight into one (Tensor views, no host copy), so tensor bytes skip moed, the
// sockets and the worker's own buffers. On a CUDA worker each mapping is also page-locked
// (cudaHostRegister) so host<->device copies run from and to it at PCIe speed.
//
// A CUDA region (a client's GPU memory, shared by CUDA IPC) is opened on the worker's GPU
// instead, and the engine's tensor views point at device memory: host<->device copies become
// device-to-device copies, no host copy at all.
//
// Each region is mapped once (MAP_SHARED, read-write) and cached under moed's region id (and
// mapped again when that id names another object: ids restart with every moed). A
// step holds its mapping through ShmTensor::hold, so Forget (moed: no step uses the region any
// more) or DropIdle unmaps it only after steps still using it are done.
//
//   WorkerShmMappings shm(/*pin_for_cuda=*/false);
//   ASSIGN_OR_RETURN(ShmTensor x, shm.Input("x", request.x(), request.x_shm()));
//   ASSIGN_OR_RETURN(ShmTensor out, shm.Output("out", dtype, shape, request.out_shm()));
//   layer->Forward(x.tensor, &saved, &out.tensor);      // writes into the region
//   shm.Forget({id});            // ForgetSharedMemory
//   shm.DropIdle(absl::Now());   // on every ping
#ifndef MOED_SERVER_WORKER_SHM_H_
#define MOED_SERVER_WORKER_SHM_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/tensor.h"
#include "proto/worker.pb.h"

namespace moe {

// A view of a slice of a mapped region, and the mapping it needs kept alive.
struct ShmTensor {
  Tensor tensor;                     // Tensor::View into the region
  std::shared_ptr<const void> hold;  // keeps the mapping while the view is used
};

class WorkerShmMappings {
 public:
  // A mapping no step used for idle_unmap is unmapped by DropIdle (a lost Forget, a moed
  // that died). With pin_for_cuda, mappings are page-locked for the GPU (a failure to pin is
  // logged once and the copies go through the backend's staging instead).
  explicit WorkerShmMappings(bool pin_for_cuda = false,
                             absl::Duration idle_unmap = absl::Seconds(60))
      : pin_for_cuda_(pin_for_cuda), idle_unmap_(idle_unmap) {}
  ~WorkerShmMappings();

  // A view of `slice` as a tensor with meta's datatype and shape. INVALID_ARGUMENT when the
  // byte count does not match or the slice lies outside its region; FAILED_PRECONDITION when
  // the object under the key is not the one moed registered (another host, replaced) or too
  // short.
  absl::StatusOr<ShmTensor> Input(absl::string_view field, const v1::Tensor& meta,
                                  const internal::WorkerShmSlice& slice);
  // A view of `slice` for an output of the slice's datatype and `shape` (INTERNAL when the
  // sizes differ: moed computed the slice from the same shape and datatype).
  absl::StatusOr<ShmTensor> Output(absl::string_view field, const std::vector<int64_t>& shape,
                                   const internal::WorkerShmSlice& slice);
  // The worker's GPU, where CUDA regions are opened (-1, the default: a CPU worker, which
  // refuses them). Set when the worker learns its rank.
  void set_cuda_device(int device) { cuda_device_.store(device); }
  void Forget(const std::vector<uint64_t>& region_ids);
  void DropIdle(absl::Time now);
  int mapped() const;

 private:
  struct Mapping;
  // The region's mapping (mapped now if not cached) and the slice's bytes within it.
  absl::StatusOr<std::shared_ptr<Mapping>> Map(absl::string_view field,
                                               const internal::WorkerShmSlice& slice, char** bytes);
  // The cached mapping of the slice's region id if it maps the object the slice names (key,
  // device, inode, CUDA handle, size); a mapping of another object is dropped from the cache.
  std::shared_ptr<Mapping> CachedLocked(const internal::WorkerShmSlice& slice)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<Mapping>> MapSystem(absl::string_view field,
                                                     const internal::WorkerShmSlice& slice);
  absl::StatusOr<std::shared_ptr<Mapping>> OpenCuda(absl::string_view field,
                                                    const internal::WorkerShmSlice& slice);

  const bool pin_for_cuda_;
  const absl::Duration idle_unmap_;
  std::atomic<int> cuda_device_{-1};
  absl::Mutex open_mu_;  // held while a region is mapped or opened (before mu_)
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Mapping>> mappings_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, absl::Time> last_used_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_SHM_H_
