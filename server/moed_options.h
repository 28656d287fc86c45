// moed's options: every flag of moed read in one typed place (MoedOptionsFromFlags), and the
// checks that need nothing but the values (ValidateMoedOptions). moed_main.cc does the rest:
// files (tokens, TLS, cluster secret, checkpoint root), ports, the pool, the service, workers.
//
//   MoedOptions options = MoedOptionsFromFlags();
//   if (absl::Status valid = ValidateMoedOptions(options); !valid.ok()) { ...; return 2; }
#ifndef MOED_SERVER_MOED_OPTIONS_H_
#define MOED_SERVER_MOED_OPTIONS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/moe_service.h"
#include "server/rendezvous_store.h"
#include "server/tls.h"
#include "server/worker_pool.h"

namespace moe {

// Loopback, like the public port without a tokens file; 9090 as in the image, Compose and
// Kubernetes files (docs/METRICS.md).
inline constexpr char kDefaultMetricsListen[] = "127.0.0.1:9090";

struct MoedOptions {
  // Workers: embedded (moed starts `world` moe-workers) unless --expect_workers > 0.
  bool embedded = true;
  int workers_flag = 0;  // --workers as given (0: the device's default)
  int world = 0;         // workers started or expected; <= 0 is invalid
  std::string device = "cpu";
  std::string worker_binary;  // empty: next to moed
  bool respawn_workers = true;
  std::string worker_log_dir;

  // Ports.
  std::string listen = "127.0.0.1";
  int port = 50051;
  std::string port_file;
  std::string internal_listen = "127.0.0.1:0";
  std::string internal_port_file;
  // host:port of the Prometheus exporter; empty: none (--metrics_listen=off). A failure to
  // bind it stops moed only when the flag was given (metrics_listen_required): the default
  // is best effort, so that several moeds on one host (tests, demos) do not fail on it.
  std::string metrics_listen = kDefaultMetricsListen;
  bool metrics_listen_required = false;

  // Files: read at wiring, after validation.
  std::string tokens_file;
  TlsFiles tls;
  std::string cluster_secret_file;
  std::string state_dir;  // given: durable layers in STATE_DIR/layers (server/durable_store.h)
  std::string checkpoint_root;

  // SIGTERM / SIGINT: how long the graceful stop may take (server/graceful_stop.h).
  absl::Duration shutdown_grace = absl::Seconds(25);

  // Handed on as they are; pool.world_size is `world`. The service's checkpoint_root, auth and
  // durable_store are set at wiring.
  WorkerPoolOptions pool;
  ServiceOptions service;
  RendezvousLimits rendezvous;
};

// The flags' values (no checks; counts clamped to what the types hold). Resolves the default
// embedded worker count (DefaultEmbeddedWorkers: visible GPUs for --device=cuda).
MoedOptions MoedOptionsFromFlags();

// INVALID_ARGUMENT naming the flag at fault: no workers, an unknown --device (embedded), a
// timing or size flag that is not positive, --max_message_bytes outside [65536, 2^31),
// --max_inflight_bytes below it, a negative --shutdown_grace_s, external workers without
// --cluster_secret_file, a --listen beyond loopback without --tokens_file.
absl::Status ValidateMoedOptions(const MoedOptions& options);

}  // namespace moe

#endif  // MOED_SERVER_MOED_OPTIONS_H_
