// The Communicator seam: how the R ranks of an expert-parallel group exchange data.
//
// Implementations: LocalCommunicator (one rank, comm/local_communicator.h), Gloo over TCP
// (CPU, comm/gloo_communicator.h), NCCL (GPU, comm/nccl_communicator.h). Buffers live in
// memory_space(): host memory for local and Gloo, device memory (on the backend's stream)
// for NCCL. Every call is collective (all ranks call it in the same order) and returns an
// error instead of hanging when a peer is gone: each implementation has a timeout.
//
//   ASSIGN_OR_RETURN(auto comm, MakeGlooCommunicator(store, "layer0", rank, size, options));
//   RETURN_IF_ERROR(comm->AllReduceSum(counts, num_experts, DType::kInt64));
#ifndef MOED_ENGINE_COMM_COMMUNICATOR_H_
#define MOED_ENGINE_COMM_COMMUNICATOR_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/dtype.h"

namespace moe {

struct CommOptions {
  absl::Duration timeout = absl::Seconds(30);  // per collective call
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual MemorySpace memory_space() const = 0;
  virtual std::string name() const = 0;  // "local", "gloo", "nccl"

  // In place; dtype is kFloat32, kFloat64, kInt32 or kInt64. Every rank gets the same bits.
  virtual absl::Status AllReduceSum(void* data, size_t count, DType dtype) = 0;
  // recv = [rank0's send | rank1's send | ...], each bytes_per_rank long.
  virtual absl::Status AllGather(const void* send, void* recv, size_t bytes_per_rank) = 0;
  // Sends send_bytes[r] bytes to rank r (consecutive regions of `send`, in rank order) and
  // receives recv_bytes[r] bytes from rank r (consecutive regions of `recv`). The sizes must
  // agree pairwise (what r sends to me is what I expect from r); callers exchange counts first.
  // Sizes that do not (including a rank's own pair) are INVALID_ARGUMENT on the rank that
  // finds it; Gloo then breaks the group, so the peers fail at once (UNAVAILABLE).
  virtual absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_bytes,
                                 void* recv, absl::Span<const size_t> recv_bytes) = 0;
  virtual absl::Status Barrier() = 0;
};

}  // namespace moe

#endif  // MOED_ENGINE_COMM_COMMUNICATOR_H_
