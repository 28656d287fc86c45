// A worker's mappings of client shared-memory regions (moe.v1 RegisterSystemSharedMemory):
// reads its slice of a step's input straight from a region and writes its slice of the
// output straight into one, so tensor bytes skip moed and the sockets.
//
// Each region is mapped once (MAP_SHARED, read-write) and cached under moed's region id. A
// step holds its mapping through a shared_ptr, so Forget (moed: no step uses the region any
// more) or DropIdle unmaps it only after steps still using it are done.
//
//   WorkerShmMappings shm;
//   ASSIGN_OR_RETURN(Tensor x, shm.Read("x", request.x(), request.x_shm()));
//   RETURN_IF_ERROR(shm.Write(out, request.out_shm(), response->mutable_out()));
//   shm.Forget({id});            // ForgetSharedMemory
//   shm.DropIdle(absl::Now());   // on every ping
#ifndef MOED_SERVER_WORKER_SHM_H_
#define MOED_SERVER_WORKER_SHM_H_

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

class WorkerShmMappings {
 public:
  // A mapping no step used for idle_unmap is unmapped by DropIdle (a lost Forget, a moed
  // that died).
  explicit WorkerShmMappings(absl::Duration idle_unmap = absl::Seconds(60))
      : idle_unmap_(idle_unmap) {}
  ~WorkerShmMappings();

  // A host tensor with meta's datatype and shape whose bytes are copied from `slice`.
  // INVALID_ARGUMENT when the byte count does not match; FAILED_PRECONDITION when the object
  // under the key is not the one moed registered (another host, replaced) or too short.
  absl::StatusOr<Tensor> Read(absl::string_view field, const v1::Tensor& meta,
                              const internal::WorkerShmSlice& slice);
  // Copies `tensor` into `slice` (byte_size must match) and sets meta's datatype and shape
  // (no raw_data).
  absl::Status Write(const Tensor& tensor, const internal::WorkerShmSlice& slice, v1::Tensor* meta);
  void Forget(const std::vector<uint64_t>& region_ids);
  void DropIdle(absl::Time now);
  int mapped() const;

 private:
  struct Mapping;
  // The region's mapping (mapped now if not cached) and the slice's bytes within it.
  absl::StatusOr<std::shared_ptr<Mapping>> Map(absl::string_view field,
                                               const internal::WorkerShmSlice& slice, char** bytes);

  const absl::Duration idle_unmap_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Mapping>> mappings_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, absl::Time> last_used_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_SHM_H_
