// Where the engine benchmark gets its backend and communicator from, by device name. The one
// place a new backend is wired into bench/ (CUDA: see bench_backend.cc).
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, MakeBenchBackend("cpu"));
//   ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, MakeBenchCommunicator(*backend));
#ifndef MOED_BENCH_BENCH_BACKEND_H_
#define MOED_BENCH_BENCH_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/comm/communicator.h"

namespace moe {

// "cpu" (all hardware threads) or "cpu:N" (N threads for the element-wise kernels).
// Anything else is UNIMPLEMENTED until its backend is added here.
absl::StatusOr<std::unique_ptr<Backend>> MakeBenchBackend(const std::string& device);

// A single-rank communicator in the backend's memory space.
absl::StatusOr<std::unique_ptr<Communicator>> MakeBenchCommunicator(const Backend& backend);

}  // namespace moe

#endif  // MOED_BENCH_BENCH_BACKEND_H_
