// The engine's flags, read in one typed place: moe-worker's (EngineOptionsFromFlags), moed's,
// which passes those given to the workers it starts (EngineFlagsForChild), and the GPU
// benchmarks'. server/README.md "Engine flags" lists them. The defaults are the measured
// fastest; the CUDA ones other than --cuda_host_staging exist for comparisons and diagnosis.
//
//   EngineOptions engine = EngineOptionsFromFlags();
//   if (absl::Status ok = CheckEngineOptions(engine); !ok.ok()) { ...; return 2; }
//   WorkerService service(device, store, engine);
#ifndef MOED_SERVER_ENGINE_FLAGS_H_
#define MOED_SERVER_ENGINE_FLAGS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/device.h"

namespace moe {

// The flags' values, unchecked; cpu_threads stays 0 (moe-worker's --cpu_threads sets it).
EngineOptions EngineOptionsFromFlags();

// INVALID_ARGUMENT naming the flag at fault (a value out of its range).
absl::Status CheckEngineOptions(const EngineOptions& engine);

// "--name=value" for every engine flag given a value other than its default, for a child
// moe-worker's command line.
std::vector<std::string> EngineFlagsForChild();

}  // namespace moe

#endif  // MOED_SERVER_ENGINE_FLAGS_H_
