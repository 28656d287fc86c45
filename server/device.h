// The one place a worker turns its --device flag into a Backend and a Communicator.
//
// A worker makes one WorkerDevice per layer (its own backend instance and its own
// communicator under the layer's store prefix) plus one for its world group at Setup. Own
// communicators let different layers run on different threads: a Gloo context must not be
// used by two threads at once, and a layer's calls are serialised by the worker anyway.
//
//   ASSIGN_OR_RETURN(WorkerDevice device,
//                    MakeWorkerDevice("cpu", store, "g3/layer/7", rank, size, options));
//   ASSIGN_OR_RETURN(auto layer, MoeLayer::Create(config, device.backend.get(),
//                                                 device.comm.get()));
//
// Devices: "cpu" (CPU backend + Gloo over TCP); "cuda:N" (CUDA backend on GPU N + NCCL) and
// "cuda" (GPU rank % visible GPUs, so that `moed --device=cuda --workers=<GPUs>` puts one
// worker on each GPU). CUDA devices need a build with CUDA (engine/cuda/cuda_optional.h).
#ifndef MOED_SERVER_DEVICE_H_
#define MOED_SERVER_DEVICE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/comm/communicator.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/comm/kv_store.h"
#include "engine/comm/metered_communicator.h"
#include "engine/cuda/cuda_backend_options.h"
#include "engine/moe_layer.h"

namespace moe {

// Everything a worker's flags set in the engine (server/engine_flags.h; moe-worker's
// --cpu_threads): its backends and communicators (MakeWorkerDevice) and its layers
// (MoeLayer::Create).
struct EngineOptions {
  int cpu_threads = 0;  // the CPU backend's element-wise kernels (0: one per hardware thread)
  GlooTransportOptions gloo;
  CudaBackendOptions cuda;
  MoeLayerOptions layer;
};

struct WorkerDevice {
  std::unique_ptr<Backend> backend;
  // The backend's communicator (Gloo or NCCL), metered: its all-to-all traffic per step is
  // reported to moed (WorkerStepTiming).
  std::unique_ptr<MeteredCommunicator> comm;
};

// Checks the flag's syntax and that the device exists here, without building anything.
absl::Status CheckDeviceFlag(const std::string& device_flag);

// Embedded moed's worker count when --workers is not given: one per visible GPU for
// --device=cuda (0 when none is visible), 2 otherwise.
int DefaultEmbeddedWorkers(const std::string& device_flag);

// The device a worker of `rank` runs on, as GetStatus shows it: "cuda" becomes "cuda:N" (the
// GPU picked for that rank); every other flag, or a rank < 0, returns the flag as it is.
std::string DeviceName(const std::string& device_flag, int rank);
// The GPU a worker of `rank` runs on (as DeviceName), -1 for the CPU device.
int CudaOrdinal(const std::string& device_flag, int rank);

// Memory of the device a worker of `rank` runs on: a GPU's total memory, or the host's
// physical memory for the CPU device; 0 when unknown (PingResponse.memory_capacity_bytes).
int64_t DeviceMemoryCapacity(const std::string& device_flag, int rank);

// Collective: every rank of the group calls it with the same prefix and size. The backend and
// the communicator are made as `engine` says (its cpu_threads, gloo or cuda).
absl::StatusOr<WorkerDevice> MakeWorkerDevice(const std::string& device_flag,
                                              std::shared_ptr<KeyValueStore> store,
                                              const std::string& prefix, int rank, int size,
                                              const CommOptions& options,
                                              const EngineOptions& engine = {});

}  // namespace moe

#endif  // MOED_SERVER_DEVICE_H_
