// moed's own shared-memory buffers for the tensor bytes of gRPC steps whose workers run on
// moed's host (docs/DECISIONS.md, the row "moed forwards received bytes").
//
// A step that arrives over gRPC used to cross a second socket to every worker and back
// (moed -> worker -> moed), as gRPC messages on one connection each: on the H200 host that hop
// moved ~1.7 GB/s per direction, half of a step's transport time. With a relay buffer moed
// copies the request's rows once into a buffer the local workers map (as they map a client's
// region: server/worker_shm.h, page-locked on CUDA workers so host-to-device copies run from
// it directly), the workers write the output into a second one, and moed answers the client
// with slices over that buffer (no copy): the moed <-> worker hop carries no tensor bytes.
//
// Buffers hold other callers' tensors, so no client may reach them: each is an anonymous memfd
// (memfd_create "moed-relay-<pid>-<n>": no /dev/shm name to open or link), which the local
// workers open as /proc/<moed pid>/fd/<fd> (moed's user only, as ptrace would need) and
// RegisterSystemSharedMemory refuses by its identity (MarkOwnShmObject, server/shared_memory.h).
// Sized in powers of two from 1 MiB, registered in the pool's own SharedMemoryRegistry under
// their names (ids from kRelayFirstRegionId, apart from the client regions' ids) and reused: a
// worker maps each once. The pool maps at most max_bytes; past it Take returns null and the
// step goes over gRPC as before (nothing fails). A killed moed leaves nothing behind (its
// memfds go with it); /dev/shm objects named by a moed of an earlier version are unlinked.
//
//   RelayPool relay(int64_t{2} << 30);
//   std::shared_ptr<RelayBuffer> in = relay.Take(bytes);   // null: relay over gRPC instead
//   if (in) { input.CopyTo(in->data); ... name in->name in the workers' WorkerShmSlice ... }
//   grpc::Slice answer = RelaySlice(out, bytes);             // keeps `out` until gRPC is done
#ifndef MOED_SERVER_RELAY_POOL_H_
#define MOED_SERVER_RELAY_POOL_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "server/shared_memory.h"

namespace moe {

inline constexpr uint64_t kRelayFirstRegionId = uint64_t{1} << 48;

// One mapped buffer. Returned to its pool when the last shared_ptr to it is dropped.
struct RelayBuffer {
  std::string name;  // its region name in RelayPool::registry() (also the memfd's name)
  char* data = nullptr;
  int64_t capacity = 0;
  // Set when a worker may still be using it after its step returned (a step that failed or
  // passed its deadline): unmapped and closed at the last release instead of reused.
  std::atomic<bool> discard{false};
};

class RelayPool {
 public:
  explicit RelayPool(int64_t max_bytes);
  ~RelayPool();  // buffers still referenced are unmapped when their last reference goes
  RelayPool(const RelayPool&) = delete;
  RelayPool& operator=(const RelayPool&) = delete;

  // A buffer of at least `bytes` (> 0), or null when the pool is at max_bytes or the system
  // refused a new shm object (logged once).
  std::shared_ptr<RelayBuffer> Take(int64_t bytes);
  // Where the buffers are registered, for leases (ShmStep) naming them to the workers.
  SharedMemoryRegistry* registry();
  // Bytes mapped now (in use or kept for reuse).
  int64_t mapped_bytes() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// The relay buffers of one step (MoeServiceImpl::RelayLocally): each null when that tensor does
// not go through the relay (a client region, remote workers, a full pool).
struct RelayStep {
  std::shared_ptr<RelayBuffer> input;   // holds the request's rows for the workers to read
  std::shared_ptr<RelayBuffer> output;  // the workers write the answer's rows here
  int64_t output_bytes = 0;
  // The step failed: its workers may still read or write the buffers (RelayBuffer::discard).
  // Returns `status`, marking both buffers discarded when it is an error.
  absl::Status DiscardIfFailed(absl::Status status) {
    if (status.ok()) return status;
    if (input) input->discard = true;
    if (output) output->discard = true;
    return status;
  }
};

// A slice over the first `bytes` of `buffer`, which it keeps alive (and out of the pool) until
// gRPC releases the slice.
grpc::Slice RelaySlice(std::shared_ptr<RelayBuffer> buffer, int64_t bytes);

}  // namespace moe

#endif  // MOED_SERVER_RELAY_POOL_H_
