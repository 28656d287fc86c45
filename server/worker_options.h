// moe-worker's options: every flag of moe-worker read in one typed place
// (WorkerOptionsFromFlags), and the checks that need nothing but the values
// (ValidateWorkerOptions). worker_main.cc does the rest: the secret, its port, join, watchdog.
//
//   WorkerOptions options = WorkerOptionsFromFlags();
//   if (absl::Status valid = ValidateWorkerOptions(options); !valid.ok()) { ...; return 2; }
#ifndef MOED_SERVER_WORKER_OPTIONS_H_
#define MOED_SERVER_WORKER_OPTIONS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/device.h"

namespace moe {

struct WorkerOptions {
  std::string frontend;  // host:port of moed's internal plane; required
  // The cluster secret: exactly one of a file and an inherited descriptor (embedded mode).
  std::string cluster_secret_file;
  int cluster_secret_fd = -1;
  std::string device = "cpu";
  int rank = -1;  // requested rank; -1: any free one
  std::string listen = "127.0.0.1:0";
  std::string advertise_host;  // empty: see AdvertiseHost in worker_main.cc
  // The interface of NCCL's and Gloo's peer traffic, NCCL_SOCKET_IFNAME's conventions
  // (server/socket_ifname.h); empty: NCCL chooses, Gloo listens on the advertised host.
  std::string socket_ifname;
  absl::Duration join_timeout = absl::Seconds(60);
  // Join again when the front end has not pinged for this long (zero: never; readiness then
  // uses 5 s).
  absl::Duration rejoin_after = absl::Seconds(5);
  // Exit when the front end has been silent this long (zero: never).
  absl::Duration orphan_timeout = absl::Seconds(60);
  // The engine flags (server/engine_flags.h) and --cpu_threads (0: one per hardware thread).
  // gloo empty: worker_main.cc has Gloo listen on the advertised host.
  EngineOptions engine;
  // Its ring threads' doorbell spin before they sleep (--ring_spin_us, server/ring_spin.h).
  absl::Duration ring_spin = absl::ZeroDuration();
};

// The flags' values, unchecked.
WorkerOptions WorkerOptionsFromFlags();

// INVALID_ARGUMENT naming the flag at fault: no --frontend, an unknown --device, not exactly one
// of --cluster_secret_file and --cluster_secret_fd, a --socket_ifname naming no interface, an
// engine flag out of range.
absl::Status ValidateWorkerOptions(const WorkerOptions& options);

}  // namespace moe

#endif  // MOED_SERVER_WORKER_OPTIONS_H_
