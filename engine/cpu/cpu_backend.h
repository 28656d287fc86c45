// The CPU backend: every kernel of engine/backend.h on host memory.
//
// GEMMs go through OpenBLAS cblas_sgemm (multithreaded; bf16 operands are widened to fp32
// temporaries, bf16 results are rounded from the fp32 result). Everything else is plain C++
// parallelised only over independent rows or tokens, never inside a reduction, so results are
// bit-identical from run to run. Kernels run synchronously on the calling thread (plus a
// small pool of worker threads), so the "stream" is trivially in order.
//
//   std::unique_ptr<Backend> backend = MakeCpuBackend();
//   std::unique_ptr<Communicator> comm = MakeLocalCommunicator();
//   ASSIGN_OR_RETURN(auto layer, MoeLayer::Create(config, backend.get(), comm.get()));
#ifndef MOED_ENGINE_CPU_CPU_BACKEND_H_
#define MOED_ENGINE_CPU_CPU_BACKEND_H_

#include <memory>

#include "engine/backend.h"

namespace moe {

// `threads` <= 0: one per hardware thread. Used for the element-wise and row kernels.
std::unique_ptr<Backend> MakeCpuBackend(int threads = 0);

}  // namespace moe

#endif  // MOED_ENGINE_CPU_CPU_BACKEND_H_
