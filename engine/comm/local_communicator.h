// The single-rank Communicator: EP size 1, rank 0. Collectives over one rank are copies
// (AllGather, AllToAllV) or no-ops (AllReduceSum, Barrier), so a layer runs its one
// dispatch/combine code path unchanged at R = 1. Host memory only: for device memory this
// returns errors (use the NCCL communicator, whose size may be 1, instead).
//
//   std::unique_ptr<Communicator> comm = MakeLocalCommunicator(MemorySpace::kHost);
//   ASSIGN_OR_RETURN(auto layer, MoeLayer::Create(config, backend.get(), comm.get()));
#ifndef MOED_ENGINE_COMM_LOCAL_COMMUNICATOR_H_
#define MOED_ENGINE_COMM_LOCAL_COMMUNICATOR_H_

#include <memory>

#include "engine/comm/communicator.h"

namespace moe {

// `space` is reported by memory_space(); every data-moving call fails with
// FAILED_PRECONDITION when it is kDevice (plain memcpy cannot touch device memory).
std::unique_ptr<Communicator> MakeLocalCommunicator(MemorySpace space = MemorySpace::kHost);

}  // namespace moe

#endif  // MOED_ENGINE_COMM_LOCAL_COMMUNICATOR_H_
