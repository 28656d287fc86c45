#include "server/device.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/status_macros.h"

namespace moe {

absl::Status CheckDeviceFlag(const std::string& device_flag) {
  if (device_flag == "cpu") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--device=", device_flag, ": unsupported device (this build knows \"cpu\")"));
}

absl::StatusOr<WorkerDevice> MakeWorkerDevice(const std::string& device_flag,
                                              std::shared_ptr<KeyValueStore> store,
                                              const std::string& prefix, int rank, int size,
                                              const CommOptions& options) {
  RETURN_IF_ERROR(CheckDeviceFlag(device_flag));
  WorkerDevice device;
  // Expert kernels of one layer run on the worker's handler thread plus this pool; several
  // layers may run at once, so keep each pool modest.
  device.backend = MakeCpuBackend();
  ASSIGN_OR_RETURN(device.comm,
                   MakeGlooCommunicator(std::move(store), prefix, rank, size, options));
  return device;
}

}  // namespace moe
