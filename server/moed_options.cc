// moed's flags and the checks of their values (server/moed_options.h).
#include "server/moed_options.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "server/device.h"
#include "server/moed_util.h"
#include "server/ring_spin.h"

ABSL_FLAG(std::string, listen, "127.0.0.1",
          "address the gRPC port binds (default loopback only; 0.0.0.0 or an interface's "
          "address to serve other hosts: see docs/SECURITY.md first)");
ABSL_FLAG(int, port, 50051, "gRPC port (0: pick a free one; see --port_file)");
ABSL_FLAG(std::string, port_file, "", "write the bound gRPC port here once listening");
ABSL_FLAG(int, workers, 0,
          "embedded mode: start this many local moe-worker processes (0: one per visible GPU "
          "with --device=cuda, else 2)");
ABSL_FLAG(int, expect_workers, 0,
          "external mode (> 0): start no workers, wait for this many to join");
ABSL_FLAG(std::string, device, "cpu", "embedded mode: --device of the started workers");
ABSL_FLAG(std::string, worker_binary, "",
          "embedded mode: moe-worker executable (default: next to this binary)");
ABSL_FLAG(bool, respawn_workers, true, "embedded mode: restart a worker that exits");
ABSL_FLAG(std::string, worker_log_dir, "",
          "embedded mode: append worker r's stdout and stderr to DIR/worker-<r>.log (created "
          "if missing; empty: the workers write to moed's stderr)");
ABSL_FLAG(std::string, internal_listen, "127.0.0.1:0",
          "host:port of the internal plane (moe.internal.Coordinator, which workers join "
          "through: moe-worker --frontend); loopback by default, port 0 picks one (see "
          "--internal_port_file)");
ABSL_FLAG(std::string, internal_port_file, "", "write the bound internal port here once listening");
ABSL_FLAG(std::string, tokens_file, "",
          "bearer tokens and roles of the public API (server/auth.h; reloaded on SIGHUP). "
          "Without it every call is allowed and moed serves loopback only");
ABSL_FLAG(std::string, tls_cert_file, "", "public port: TLS certificate chain (PEM)");
ABSL_FLAG(std::string, tls_key_file, "", "public port: TLS private key (PEM)");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "public port: require client certificates signed by this CA (mutual TLS)");
ABSL_FLAG(std::string, state_dir, "",
          "folder of moed's own state (default $XDG_STATE_HOME/moed, else "
          "$HOME/.local/state/moed). Given explicitly, layers are durable: the registry and "
          "each layer's latest durable checkpoint live in STATE_DIR/layers, and a restart "
          "restores them (server/README.md, failure model). Not given: a restart loses every "
          "layer");
ABSL_FLAG(int64_t, durable_every_steps, 100,
          "with --state_dir: checkpoint a layer after this many optimizer steps since its last "
          "durable checkpoint (0: off)");
ABSL_FLAG(int64_t, shutdown_grace_s, 25,
          "on SIGTERM/SIGINT: the running calls finish and every layer changed since its "
          "durable checkpoint is written within this many seconds; then (or at a second "
          "signal) moed exits with what is written. Below Kubernetes' default "
          "terminationGracePeriodSeconds (30)");
ABSL_FLAG(int64_t, durable_every_s, 300,
          "with --state_dir: checkpoint a changed layer at its next ApplyOptimizer or "
          "UpdateExpertBias once this many seconds passed since its last durable checkpoint "
          "(0: off)");
ABSL_FLAG(std::string, checkpoint_root, "",
          "the only folder SaveCheckpoint/LoadCheckpoint use (created 0700; requests name "
          "paths inside it; default STATE_DIR/checkpoints). External workers must see it at the "
          "same path");
ABSL_FLAG(std::string, cluster_secret_file, "",
          "file holding the internal plane's shared secret (at least 32 printable characters, "
          "e.g. openssl rand -hex 32; a mounted Kubernetes Secret). Required with "
          "--expect_workers (the workers read the same file); embedded mode generates one and "
          "hands it to its workers through an inherited file descriptor");
ABSL_FLAG(int64_t, rendezvous_max_bytes, int64_t{64} << 20,
          "rendezvous store (worker communicator bootstrap): keys + values held at once, bytes");
ABSL_FLAG(int64_t, rendezvous_max_keys, 65536, "rendezvous store: keys held at once");
ABSL_FLAG(int64_t, rendezvous_max_waiting, 256,
          "rendezvous store: StoreGets waiting for a key at once (all callers)");
ABSL_FLAG(int64_t, rendezvous_max_waiting_per_caller, 32,
          "rendezvous store: StoreGets waiting for a key at once per caller (connection)");
ABSL_FLAG(int64_t, stream_idle_timeout_s, 60,
          "cancel a GetWeights/GetGradients/SetWeights stream whose client has not taken (or "
          "sent) the next message for this many seconds, freeing what it holds");
ABSL_FLAG(std::string, metrics_listen, moe::kDefaultMetricsListen,
          "serve Prometheus metrics over HTTP at /metrics on this host:port (a bare port: "
          "loopback; off: none). The default, loopback port 9090, is best effort: when it is "
          "taken (another moed on this host) moed logs it and runs without metrics; a value "
          "given here that cannot be bound stops moed. Metrics say nothing secret but name "
          "layers: bind beyond loopback only where the scraper needs it");
ABSL_FLAG(int64_t, max_saved_steps, 64, "per layer: steps kept for backward at once");
ABSL_FLAG(int64_t, max_saved_bytes, int64_t{8} << 30,
          "per layer: worker memory (bytes, all workers) held by saved steps");
ABSL_FLAG(int64_t, saved_step_ttl_s, 600,
          "release a saved step (keep_for_backward) not used by Backward within this many "
          "seconds (0: never)");
ABSL_FLAG(int64_t, step_timeout_ms, 30000,
          "deadline of every internal step call; a step past it fails alone (DEADLINE_EXCEEDED) "
          "and its layer waits until the workers finished it");
ABSL_FLAG(int64_t, dp_step_timeout_ms, 300000,
          "a data-parallel ApplyOptimizer step (num_ranks > 1) whose ranks did not all call "
          "within this long of its first call is dropped: the waiting calls are ABORTED");
ABSL_FLAG(int64_t, max_dp_ranks, 1024,
          "the largest num_ranks a data-parallel ApplyOptimizer step may declare (2 to 4096); "
          "more is INVALID_ARGUMENT");
ABSL_FLAG(int64_t, overdue_call_limit_s, 600,
          "a call still running on live workers this long after its deadline means a wedged "
          "worker: the workers re-form");
ABSL_FLAG(int64_t, collective_timeout_ms, 30000, "per-collective timeout inside the workers");
ABSL_FLAG(int64_t, heartbeat_ms, 500, "interval of the worker liveness pings");
ABSL_FLAG(int64_t, ping_timeout_ms, 1000, "deadline of one liveness ping");
ABSL_FLAG(int64_t, worker_dead_after_ms, 3000,
          "a worker that answers no ping for this long is dead (requests fail UNAVAILABLE)");
ABSL_FLAG(int64_t, setup_timeout_ms, 60000, "deadline of the workers' communicator setup");
ABSL_FLAG(int64_t, max_layer_bytes, int64_t{1} << 40,
          "refuse layers whose parameters + gradients + optimizer state (4 x fp32 per "
          "parameter, all workers) exceed this many bytes");
ABSL_FLAG(int64_t, max_layers, 1024,
          "layers that may exist at once; a CreateLayer beyond it is RESOURCE_EXHAUSTED (each "
          "layer holds a communicator on every worker)");
ABSL_FLAG(int64_t, worker_memory_bytes, 0,
          "memory one worker may hold for layers and steps: its layers (parameters, gradients, "
          "optimizer state), the steps kept for backward and a running step's estimated "
          "working memory; a CreateLayer, Forward or Backward that would pass it is refused "
          "(RESOURCE_EXHAUSTED) before any worker allocates. 0: derived from the memory the "
          "workers report (90% of a GPU's, 80% of a host's physical memory shared by the "
          "CPU workers on it); -1: no admission control");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{256} << 20,
          "largest public request/response message (bytes)");
ABSL_FLAG(int64_t, handler_threads, 1024,
          "public calls whose bodies may run at once (each may wait for a layer's turn and for "
          "the workers on its own thread); beyond it a call is RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, handler_threads_per_client, 256,
          "public calls of one client (its token with --tokens_file, else its address) whose "
          "bodies may run at once; beyond it that client's call is RESOURCE_EXHAUSTED (0: no "
          "per-client limit)");
ABSL_FLAG(int64_t, max_inflight_bytes, int64_t{4} << 30,
          "bytes of requests in flight in moed: gRPC's buffers of incoming messages (a "
          "grpc::ResourceQuota on the public port) and, separately, the tensors "
          "ForwardStream/BackwardStream steps assemble (counted by the size their first "
          "message announces); beyond it RESOURCE_EXHAUSTED. At least --max_message_bytes");
ABSL_FLAG(int64_t, max_stream_bytes, int64_t{16} << 30,
          "whole-layer tensors that open GetWeights/GetGradients/SetWeights streams (all "
          "clients) may hold in moed at once (bytes); one stream alone is always served");
ABSL_FLAG(bool, allow_client_shm, false,
          "let clients on this host register POSIX shared-memory regions and name Forward / "
          "Backward tensors in them (RegisterSystemSharedMemory); off: those calls are "
          "UNIMPLEMENTED");
ABSL_FLAG(int64_t, shm_idle_timeout_s, 600,
          "unregister a client shared-memory region that no step used for this many seconds "
          "(a client that died; 0: never)");
ABSL_FLAG(int64_t, max_step_channels, 64,
          "step channels (OpenStepChannel, with --allow_client_shm) open at once, all clients; "
          "beyond it RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_step_channels_per_client, 8,
          "step channels one client (token, else host) may hold open at once (0: no "
          "per-client bound)");
ABSL_FLAG(int64_t, max_step_channel_bytes, int64_t{64} << 20,
          "largest ring a step channel may ask for (bytes, a power of two >= 65536); each "
          "channel uses two rings of /dev/shm");
ABSL_FLAG(bool, shm_relay, true,
          "steps whose tensors arrive over gRPC reach workers on this host (loopback "
          "addresses) through moed's own shared-memory buffers (anonymous memfds) instead "
          "of a second gRPC hop; off: over gRPC. Independent of --allow_client_shm");
ABSL_FLAG(int64_t, shm_relay_max_bytes, int64_t{2} << 30,
          "most shared memory the relay buffers may use (bytes); a step that does not fit, or "
          "memory the system refuses, goes over gRPC");
ABSL_FLAG(bool, forward_batching, true,
          "merge inference forwards (no keep_for_backward) of several callers on one layer into "
          "one worker step, each caller answered with its own rows, bit for bit what its "
          "forward alone gives on CPU (server/README.md, \"Cross-caller batching\"); "
          "--noforward_batching: every forward is its own step");
ABSL_FLAG(int64_t, forward_batch_delay_us, 300,
          "with --forward_batching: the longest a forward waits for others to join its step "
          "(0: batches form only while the layer's previous merged step runs)");
ABSL_FLAG(int64_t, forward_batch_max_tokens, 8192,
          "with --forward_batching: the most tokens of one merged forward step; a forward "
          "larger than this runs alone");
ABSL_FLAG(int64_t, staged_ttl_s, 60,
          "drop a staged tensor (StageTensor, out_staged / d_x_staged) unused for this many "
          "seconds (a client that died mid-step)");
// ---- same-host step rings, moed -> worker (server/worker_rings.h) ----
ABSL_FLAG(bool, worker_ring, true,
          "send the per-step calls (Forward, Backward, ReleaseStep) to workers on this host "
          "(loopback addresses) as records on shared-memory rings instead of gRPC calls; off, "
          "or for workers on other hosts: gRPC");
ABSL_FLAG(int64_t, worker_ring_channels, 4,
          "with --worker_ring: ring channels per worker, i.e. steps (of different layers) in "
          "flight on rings to one worker at once; a step finding all busy goes over gRPC");
ABSL_FLAG(int64_t, worker_ring_bytes, int64_t{1} << 20,
          "with --worker_ring: bytes of each direction's ring (a power of two in [64 KiB, "
          "1 GiB]); a step whose request (or twice it, for its answer) does not fit a record "
          "goes over gRPC");
// ---- end of the step rings ----

namespace moe {

MoedOptions MoedOptionsFromFlags() {
  MoedOptions o;
  const int expect = absl::GetFlag(FLAGS_expect_workers);
  o.embedded = expect <= 0;
  o.workers_flag = absl::GetFlag(FLAGS_workers);
  o.device = absl::GetFlag(FLAGS_device);
  o.world = o.embedded ? o.workers_flag : expect;
  if (o.embedded && o.world == 0) o.world = DefaultEmbeddedWorkers(o.device);
  o.worker_binary = absl::GetFlag(FLAGS_worker_binary);
  o.respawn_workers = absl::GetFlag(FLAGS_respawn_workers);
  o.worker_log_dir = absl::GetFlag(FLAGS_worker_log_dir);

  o.listen = absl::GetFlag(FLAGS_listen);
  o.port = absl::GetFlag(FLAGS_port);
  o.port_file = absl::GetFlag(FLAGS_port_file);
  o.internal_listen = absl::GetFlag(FLAGS_internal_listen);
  o.internal_port_file = absl::GetFlag(FLAGS_internal_port_file);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o.metrics_listen_required = o.metrics_listen != kDefaultMetricsListen;
  if (o.metrics_listen == "off") o.metrics_listen.clear();
  if (!o.metrics_listen.empty() &&
      o.metrics_listen.find_first_not_of("0123456789") == std::string::npos) {
    o.metrics_listen = "127.0.0.1:" + o.metrics_listen;  // civetweb would bind every interface
  }

  o.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  o.tls = TlsFiles{absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file),
                   absl::GetFlag(FLAGS_tls_client_ca_file)};
  o.cluster_secret_file = absl::GetFlag(FLAGS_cluster_secret_file);
  o.state_dir = absl::GetFlag(FLAGS_state_dir);
  o.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  o.shutdown_grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));

  o.pool.world_size = o.world;
  o.pool.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_ms));
  o.pool.ping_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_ping_timeout_ms));
  o.pool.dead_after = absl::Milliseconds(absl::GetFlag(FLAGS_worker_dead_after_ms));
  o.pool.setup_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_setup_timeout_ms));
  o.pool.collective_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_collective_timeout_ms));
  o.pool.rings.enabled = absl::GetFlag(FLAGS_worker_ring);
  o.pool.rings.channels_per_worker =
      static_cast<int>(std::clamp<int64_t>(absl::GetFlag(FLAGS_worker_ring_channels), 0, 1024));
  o.pool.rings.ring_bytes = static_cast<uint64_t>(
      std::max<int64_t>(0, absl::GetFlag(FLAGS_worker_ring_bytes)));
  o.pool.rings.max_spin = RingSpinFromFlag();

  ServiceOptions& s = o.service;
  s.max_saved_steps = absl::GetFlag(FLAGS_max_saved_steps);
  s.max_saved_bytes = absl::GetFlag(FLAGS_max_saved_bytes);
  s.step_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_step_timeout_ms));
  s.overdue_call_limit = absl::Seconds(absl::GetFlag(FLAGS_overdue_call_limit_s));
  s.dp_step_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_dp_step_timeout_ms));
  s.max_dp_ranks =
      static_cast<int>(std::clamp<int64_t>(absl::GetFlag(FLAGS_max_dp_ranks), INT_MIN, INT_MAX));
  s.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  s.max_stream_bytes = absl::GetFlag(FLAGS_max_stream_bytes);
  s.handler_threads =
      static_cast<int>(std::min<int64_t>(absl::GetFlag(FLAGS_handler_threads), 1 << 16));
  s.handler_threads_per_client =
      static_cast<int>(std::min<int64_t>(absl::GetFlag(FLAGS_handler_threads_per_client), 1 << 16));
  s.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  s.max_layer_bytes = absl::GetFlag(FLAGS_max_layer_bytes);
  s.max_layers = absl::GetFlag(FLAGS_max_layers);
  s.worker_memory_bytes = absl::GetFlag(FLAGS_worker_memory_bytes);
  s.saved_step_ttl = absl::Seconds(absl::GetFlag(FLAGS_saved_step_ttl_s));
  s.stream_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_stream_idle_timeout_s));
  s.allow_client_shm = absl::GetFlag(FLAGS_allow_client_shm);
  s.shm_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_shm_idle_timeout_s));
  s.max_step_channels = static_cast<int>(
      std::clamp<int64_t>(absl::GetFlag(FLAGS_max_step_channels), -1, 1 << 20));
  s.max_step_channels_per_client = static_cast<int>(
      std::clamp<int64_t>(absl::GetFlag(FLAGS_max_step_channels_per_client), -1, 1 << 20));
  s.max_step_channel_bytes = static_cast<uint64_t>(
      std::max<int64_t>(absl::GetFlag(FLAGS_max_step_channel_bytes), 0));
  s.step_channel_spin = RingSpinFromFlag();
  s.shm_relay = absl::GetFlag(FLAGS_shm_relay);
  s.shm_relay_max_bytes = absl::GetFlag(FLAGS_shm_relay_max_bytes);
  s.staged_ttl = absl::Seconds(absl::GetFlag(FLAGS_staged_ttl_s));
  s.forward_batching.enabled = absl::GetFlag(FLAGS_forward_batching);
  s.forward_batching.max_delay = absl::Microseconds(absl::GetFlag(FLAGS_forward_batch_delay_us));
  s.forward_batching.max_tokens = absl::GetFlag(FLAGS_forward_batch_max_tokens);
  s.durable_every_steps = absl::GetFlag(FLAGS_durable_every_steps);
  s.durable_every = absl::Seconds(absl::GetFlag(FLAGS_durable_every_s));

  o.rendezvous.max_bytes = absl::GetFlag(FLAGS_rendezvous_max_bytes);
  o.rendezvous.max_keys = absl::GetFlag(FLAGS_rendezvous_max_keys);
  o.rendezvous.max_waiting =
      static_cast<int>(std::min<int64_t>(absl::GetFlag(FLAGS_rendezvous_max_waiting), 1 << 20));
  o.rendezvous.max_waiting_per_caller = static_cast<int>(
      std::min<int64_t>(absl::GetFlag(FLAGS_rendezvous_max_waiting_per_caller), 1 << 20));
  return o;
}

absl::Status ValidateMoedOptions(const MoedOptions& o) {
  if (o.world <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers or --expect_workers must be > 0",
                     o.embedded && o.workers_flag == 0 ? " (no CUDA device visible)" : ""));
  }
  if (o.embedded) RETURN_IF_ERROR(CheckDeviceFlag(o.device));
  const ServiceOptions& s = o.service;
  for (const auto& [name, value] : std::vector<std::pair<const char*, int64_t>>{
           {"heartbeat_ms", absl::ToInt64Milliseconds(o.pool.heartbeat_interval)},
           {"ping_timeout_ms", absl::ToInt64Milliseconds(o.pool.ping_timeout)},
           {"worker_dead_after_ms", absl::ToInt64Milliseconds(o.pool.dead_after)},
           {"step_timeout_ms", absl::ToInt64Milliseconds(s.step_timeout)},
           {"dp_step_timeout_ms", absl::ToInt64Milliseconds(s.dp_step_timeout)},
           {"overdue_call_limit_s", absl::ToInt64Seconds(s.overdue_call_limit)},
           {"collective_timeout_ms", absl::ToInt64Milliseconds(o.pool.collective_timeout)},
           {"max_stream_bytes", s.max_stream_bytes},
           {"max_layers", s.max_layers},
           {"max_inflight_bytes", s.max_inflight_bytes},
           {"handler_threads", s.handler_threads},
           {"setup_timeout_ms", absl::ToInt64Milliseconds(o.pool.setup_timeout)},
           {"rendezvous_max_bytes", o.rendezvous.max_bytes},
           {"rendezvous_max_keys", o.rendezvous.max_keys},
           {"rendezvous_max_waiting", o.rendezvous.max_waiting},
           {"rendezvous_max_waiting_per_caller", o.rendezvous.max_waiting_per_caller},
           {"stream_idle_timeout_s", absl::ToInt64Seconds(s.stream_idle_timeout)},
           {"forward_batch_max_tokens", s.forward_batching.max_tokens}}) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be > 0, got ", value));
    }
  }
  if (s.max_dp_ranks < 2 || s.max_dp_ranks > kMaxDataParallelRanks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_dp_ranks must be in [2, ", kMaxDataParallelRanks, "], got ", s.max_dp_ranks));
  }
  const uint64_t ring_bytes = o.pool.rings.ring_bytes;
  if (o.pool.rings.enabled &&
      (o.pool.rings.channels_per_worker < 1 || ring_bytes < (uint64_t{1} << 16) ||
       ring_bytes > (uint64_t{1} << 30) || (ring_bytes & (ring_bytes - 1)) != 0)) {
    return absl::InvalidArgumentError(
        "--worker_ring_channels must be in [1, 1024] and --worker_ring_bytes a power of two in "
        "[65536, 2^30]");
  }
  RETURN_IF_ERROR(CheckRingSpin(s.step_channel_spin));
  if (s.max_step_channels < 1) {
    return absl::InvalidArgumentError("--max_step_channels must be >= 1");
  }
  if (s.max_step_channels_per_client < 0) {
    return absl::InvalidArgumentError("--max_step_channels_per_client must be >= 0 (0: none)");
  }
  const uint64_t channel_bytes = s.max_step_channel_bytes;
  if (channel_bytes < (uint64_t{64} << 10) || channel_bytes > (uint64_t{1} << 30) ||
      (channel_bytes & (channel_bytes - 1)) != 0) {
    return absl::InvalidArgumentError(
        "--max_step_channel_bytes must be a power of two in [65536, 2^30]");
  }
  if (s.forward_batching.max_delay < absl::ZeroDuration() ||
      s.forward_batching.max_delay > absl::Seconds(1)) {
    return absl::InvalidArgumentError("--forward_batch_delay_us must be in [0, 1000000]");
  }
  if (s.shm_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--shm_idle_timeout_s must be >= 0 (0: never)");
  }
  if (s.saved_step_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--saved_step_ttl_s must be >= 0 (0: never), got ",
                     absl::ToInt64Seconds(s.saved_step_ttl)));
  }
  if (s.worker_memory_bytes < -1) {
    return absl::InvalidArgumentError(
        "--worker_memory_bytes must be > 0, 0 (derived from the workers) or -1 (off)");
  }
  if (s.max_message_bytes < (1 << 16) || s.max_message_bytes > INT32_MAX) {
    return absl::InvalidArgumentError("--max_message_bytes must be in [65536, 2^31)");
  }
  if (s.max_inflight_bytes < s.max_message_bytes || s.handler_threads_per_client < 0) {
    return absl::InvalidArgumentError(
        "--max_inflight_bytes must be at least --max_message_bytes, and "
        "--handler_threads_per_client >= 0");
  }
  if (!o.state_dir.empty() &&
      (s.durable_every_steps < 0 || s.durable_every < absl::ZeroDuration())) {
    return absl::InvalidArgumentError("--durable_every_steps and --durable_every_s must be >= 0");
  }
  if (o.shutdown_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--shutdown_grace_s must be >= 0");
  }
  if (o.tokens_file.empty() && !IsLoopback(o.listen)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen=", o.listen,
        " reaches beyond loopback, but there is no --tokens_file: anyone who reaches the port "
        "could drive the service. Give a tokens file (docs/SECURITY.md) or listen on loopback"));
  }
  if (!o.embedded && o.cluster_secret_file.empty()) {
    return absl::InvalidArgumentError(
        "--expect_workers needs --cluster_secret_file=PATH (the same file for moed and every "
        "moe-worker; e.g. openssl rand -hex 32 > PATH; chmod 600 PATH)");
  }
  return absl::OkStatus();
}

}  // namespace moe
