// The NCCL communicator: the ranks of an expert-parallel group on GPUs (one GPU per rank, any
// number of hosts). Buffers are device memory; every operation is enqueued on the CUDA stream
// given at creation (the backend's, Backend::stream()), so it is ordered with the backend's
// kernels and the host does not wait, except in Barrier.
//
// Rendezvous: rank 0 creates the ncclUniqueId and publishes it in `store` under
// "<prefix>/nccl_unique_id"; the others wait for it (CommOptions::timeout). Initialisation is
// non-blocking (ncclConfig_t.blocking = 0) and polled until the timeout; on failure or timeout
// the communicator is aborted (ncclCommAbort) and an error returned: DEADLINE_EXCEEDED when a
// peer never came, UNAVAILABLE for an NCCL failure.
//
// Failures later on: NCCL kernels that wait for a dead peer would spin forever, so a watchdog
// thread follows every enqueued operation (a CUDA event after it) and aborts the communicator
// when one is not done CommOptions::timeout after it was enqueued, or when NCCL reports an
// asynchronous error. After that every call fails at once with UNAVAILABLE, and the stream's
// pending work fails instead of hanging.
//
// Threads: calls on one communicator come from one thread at a time (the layer serialises
// them); the watchdog thread touches NCCL only under the same mutex as those calls, because
// NCCL's non-blocking progress (ncclCommGetAsyncError) must not run on two threads at once
// (seen on the GPU machine as heap corruption and hangs before the mutex existed).
//
// AllToAllV is one NCCL group of ncclSend/ncclRecv per peer with byte counts, this rank's
// own part included (one rank: a device memcpy). The sizes must agree pairwise (the engine
// derives them from all-gathered counts); NCCL cannot check that, and a mismatch ends in the
// watchdog's timeout.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
//                    MakeNcclCommunicator(store, "layer-group-1", rank, size, /*device=*/rank,
//                                         backend->stream(), CommOptions{}));
//   RETURN_IF_ERROR(comm->AllReduceSum(d_gate, count, DType::kFloat32));
#ifndef MOED_ENGINE_COMM_NCCL_COMMUNICATOR_H_
#define MOED_ENGINE_COMM_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/comm/communicator.h"
#include "engine/comm/kv_store.h"

namespace moe {

// `stream` is a cudaStream_t on `device`; it must outlive the communicator.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    std::shared_ptr<KeyValueStore> store, const std::string& prefix, int rank, int size, int device,
    void* stream, const CommOptions& options);

}  // namespace moe

#endif  // MOED_ENGINE_COMM_NCCL_COMMUNICATOR_H_
