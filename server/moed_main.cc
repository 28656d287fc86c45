// moed: the front end. Serves moe.v1.MoeService, grpc.health.v1.Health (readiness "" and
// "moe.v1.MoeService", liveness "liveness": server/health.h), server reflection and
// moe.internal.Coordinator on one port, and Prometheus metrics on --metrics_listen.
//
//   moed --workers=2 --device=cpu --port=50051            # embedded: starts 2 moe-workers
//   moed --expect_workers=2 --internal_listen=0.0.0.0:50053 --cluster_secret_file=S
//   moe-worker --frontend=HOST:50053 --cluster_secret_file=S --device=cpu   # one per device
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "cli/usage.h"
#include "engine/file_util.h"
#include "server/auth.h"
#include "server/bulk_transport.h"
#include "server/checkpoint_root.h"
#include "server/cluster_secret.h"
#include "server/coordinator_service.h"
#include "server/device.h"
#include "server/durable_store.h"
#include "server/health.h"
#include "server/internal_tls.h"
#include "server/metrics.h"
#include "server/moe_service.h"
#include "server/moed_util.h"
#include "server/rendezvous_store.h"
#include "server/tls.h"
#include "server/worker_launcher.h"
#include "server/worker_pool.h"

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
ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus metrics over HTTP on this host:port at /metrics (e.g. "
          "127.0.0.1:9090; empty: off). Metrics say nothing secret but "
          "name layers: bind beyond loopback only where the scraper needs it");
ABSL_FLAG(int64_t, max_saved_steps, 64, "per layer: steps kept for backward at once");
ABSL_FLAG(int64_t, max_saved_bytes, int64_t{8} << 30,
          "per layer: worker memory (bytes, all workers) held by saved steps");
ABSL_FLAG(int64_t, saved_step_ttl_s, 600,
          "release a saved step (keep_for_backward) not used by Backward within this many "
          "seconds (0: never)");
ABSL_FLAG(int64_t, step_timeout_ms, 30000,
          "deadline of every internal step call; a step past it fails alone (DEADLINE_EXCEEDED) "
          "and its layer waits until the workers finished it");
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

namespace moe {
namespace {

int Main() {
  const int expect = absl::GetFlag(FLAGS_expect_workers);
  const bool embedded = expect <= 0;
  int world = embedded ? absl::GetFlag(FLAGS_workers) : expect;
  if (embedded && world == 0) world = DefaultEmbeddedWorkers(absl::GetFlag(FLAGS_device));
  if (world <= 0) {
    std::fprintf(stderr, "moed: --workers or --expect_workers must be > 0%s\n",
                 embedded && absl::GetFlag(FLAGS_workers) == 0 ? " (no CUDA device visible)" : "");
    return 2;
  }
  std::string worker_binary;
  if (embedded) {
    absl::Status device_ok = CheckDeviceFlag(absl::GetFlag(FLAGS_device));
    absl::StatusOr<std::string> path = WorkerBinaryPath(absl::GetFlag(FLAGS_worker_binary));
    if (!device_ok.ok() || !path.ok()) {
      std::fprintf(stderr, "moed: %s\n",
                   (device_ok.ok() ? path.status() : device_ok).ToString().c_str());
      return 2;
    }
    worker_binary = *path;
    const std::string log_dir = absl::GetFlag(FLAGS_worker_log_dir);
    if (!log_dir.empty()) {
      absl::Status made = MakeDirectories(log_dir);
      if (!made.ok()) {
        std::fprintf(stderr, "moed: --worker_log_dir: %s\n", made.ToString().c_str());
        return 2;
      }
    }
  }
  for (const auto& [name, value] : std::vector<std::pair<const char*, int64_t>>{
           {"heartbeat_ms", absl::GetFlag(FLAGS_heartbeat_ms)},
           {"ping_timeout_ms", absl::GetFlag(FLAGS_ping_timeout_ms)},
           {"worker_dead_after_ms", absl::GetFlag(FLAGS_worker_dead_after_ms)},
           {"step_timeout_ms", absl::GetFlag(FLAGS_step_timeout_ms)},
           {"overdue_call_limit_s", absl::GetFlag(FLAGS_overdue_call_limit_s)},
           {"collective_timeout_ms", absl::GetFlag(FLAGS_collective_timeout_ms)},
           {"max_stream_bytes", absl::GetFlag(FLAGS_max_stream_bytes)},
           {"max_inflight_bytes", absl::GetFlag(FLAGS_max_inflight_bytes)},
           {"handler_threads", absl::GetFlag(FLAGS_handler_threads)},
           {"setup_timeout_ms", absl::GetFlag(FLAGS_setup_timeout_ms)},
           {"rendezvous_max_bytes", absl::GetFlag(FLAGS_rendezvous_max_bytes)},
           {"rendezvous_max_keys", absl::GetFlag(FLAGS_rendezvous_max_keys)},
           {"rendezvous_max_waiting", absl::GetFlag(FLAGS_rendezvous_max_waiting)},
           {"rendezvous_max_waiting_per_caller",
            absl::GetFlag(FLAGS_rendezvous_max_waiting_per_caller)},
           {"stream_idle_timeout_s", absl::GetFlag(FLAGS_stream_idle_timeout_s)}}) {
    if (value <= 0) {
      std::fprintf(stderr, "moed: --%s must be > 0, got %lld\n", name,
                   static_cast<long long>(value));
      return 2;
    }
  }
  if (absl::GetFlag(FLAGS_shm_idle_timeout_s) < 0) {
    std::fprintf(stderr, "moed: --shm_idle_timeout_s must be >= 0 (0: never)\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_saved_step_ttl_s) < 0) {
    std::fprintf(stderr, "moed: --saved_step_ttl_s must be >= 0 (0: never), got %lld\n",
                 static_cast<long long>(absl::GetFlag(FLAGS_saved_step_ttl_s)));
    return 2;
  }
  const int64_t max_message = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message < (1 << 16) || max_message > INT32_MAX) {
    std::fprintf(stderr, "moed: --max_message_bytes must be in [65536, 2^31)\n");
    return 2;
  }
  const int64_t max_inflight = absl::GetFlag(FLAGS_max_inflight_bytes);
  const int64_t per_client = absl::GetFlag(FLAGS_handler_threads_per_client);
  if (max_inflight < max_message || per_client < 0) {
    std::fprintf(stderr,
                 "moed: --max_inflight_bytes must be at least --max_message_bytes, and "
                 "--handler_threads_per_client >= 0\n");
    return 2;
  }

  const std::string listen = absl::GetFlag(FLAGS_listen);
  std::unique_ptr<TokenAuthenticator> auth;
  if (!absl::GetFlag(FLAGS_tokens_file).empty()) {
    absl::StatusOr<std::unique_ptr<TokenAuthenticator>> loaded =
        TokenAuthenticator::Load(absl::GetFlag(FLAGS_tokens_file));
    if (!loaded.ok()) {
      std::fprintf(stderr, "moed: %s\n", loaded.status().ToString().c_str());
      return 2;
    }
    auth = std::move(*loaded);
  } else if (!IsLoopback(listen)) {
    std::fprintf(stderr,
                 "moed: --listen=%s reaches beyond loopback, but there is no --tokens_file: "
                 "anyone who reaches the port could drive the service. Give a tokens file "
                 "(docs/SECURITY.md) or listen on loopback\n",
                 listen.c_str());
    return 2;
  }
  const TlsFiles tls{absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file),
                     absl::GetFlag(FLAGS_tls_client_ca_file)};
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFromFiles(tls);
  if (!credentials.ok()) {
    std::fprintf(stderr, "moed: %s\n", credentials.status().ToString().c_str());
    return 2;
  }

  const std::string secret_file = absl::GetFlag(FLAGS_cluster_secret_file);
  if (!embedded && secret_file.empty()) {
    std::fprintf(stderr,
                 "moed: --expect_workers needs --cluster_secret_file=PATH (the same file for "
                 "moed and every moe-worker; e.g. openssl rand -hex 32 > PATH; chmod 600 PATH)\n");
    return 2;
  }
  absl::StatusOr<ClusterSecret> secret =
      secret_file.empty() ? ClusterSecret::Generate() : ClusterSecret::FromFile(secret_file);
  if (!secret.ok()) {
    std::fprintf(stderr, "moed: --cluster_secret_file: %s\n", secret.status().ToString().c_str());
    return 2;
  }

  // --internal_tls_*: the Coordinator's port and moed's calls to its workers speak mutual TLS.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> internal_credentials =
      SetUpInternalTls(&*secret);
  if (!internal_credentials.ok()) {
    std::fprintf(stderr, "moed: %s\n", internal_credentials.status().ToString().c_str());
    return 2;
  }

  absl::StatusOr<std::string> root_path =
      CheckpointRootPath(absl::GetFlag(FLAGS_checkpoint_root), absl::GetFlag(FLAGS_state_dir));
  absl::StatusOr<std::unique_ptr<CheckpointRoot>> checkpoint_root =
      root_path.ok() ? CheckpointRoot::Open(*root_path)
                     : absl::StatusOr<std::unique_ptr<CheckpointRoot>>(root_path.status());
  if (!checkpoint_root.ok()) {
    std::fprintf(stderr, "moed: --checkpoint_root: %s\n",
                 checkpoint_root.status().ToString().c_str());
    return 2;
  }

  // Durable layers: only with an explicit --state_dir (the default folder keeps today's
  // behaviour: nothing survives a restart). A damaged store or one of another version is
  // refused here, before anything is loaded.
  std::unique_ptr<DurableStore> durable_store;
  if (!absl::GetFlag(FLAGS_state_dir).empty()) {
    if (absl::GetFlag(FLAGS_durable_every_steps) < 0 || absl::GetFlag(FLAGS_durable_every_s) < 0) {
      std::fprintf(stderr, "moed: --durable_every_steps and --durable_every_s must be >= 0\n");
      return 2;
    }
    std::vector<std::string> cleaned;
    absl::StatusOr<std::unique_ptr<DurableStore>> opened =
        DurableStore::Open(AbsolutePath(absl::GetFlag(FLAGS_state_dir)) + "/layers", &cleaned);
    if (!opened.ok()) {
      std::fprintf(stderr, "moed: --state_dir: %s\n", opened.status().ToString().c_str());
      return 2;
    }
    durable_store = std::move(*opened);
    for (const std::string& path : cleaned) {
      std::fprintf(stderr, "moed: --state_dir: removed leftover %s\n", path.c_str());
    }
    std::fprintf(stderr, "moed: durable layers in %s (%zu to restore)\n",
                 durable_store->path().c_str(), durable_store->layers().size());
  }

  // Block the shutdown signals in every thread; the main thread waits for them below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);  // reloads --tokens_file
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  WorkerPoolOptions pool_options;
  pool_options.world_size = world;
  pool_options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_ms));
  pool_options.ping_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_ping_timeout_ms));
  pool_options.dead_after = absl::Milliseconds(absl::GetFlag(FLAGS_worker_dead_after_ms));
  pool_options.setup_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_setup_timeout_ms));
  pool_options.collective_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_collective_timeout_ms));
  WorkerPool pool(pool_options, *secret);

  ServiceOptions service_options;
  service_options.max_saved_steps = absl::GetFlag(FLAGS_max_saved_steps);
  service_options.max_saved_bytes = absl::GetFlag(FLAGS_max_saved_bytes);
  service_options.step_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_step_timeout_ms));
  service_options.overdue_call_limit = absl::Seconds(absl::GetFlag(FLAGS_overdue_call_limit_s));
  service_options.max_message_bytes = max_message;
  service_options.max_stream_bytes = absl::GetFlag(FLAGS_max_stream_bytes);
  service_options.handler_threads =
      static_cast<int>(std::min<int64_t>(absl::GetFlag(FLAGS_handler_threads), 1 << 16));
  service_options.handler_threads_per_client =
      static_cast<int>(std::min<int64_t>(per_client, 1 << 16));
  service_options.max_inflight_bytes = max_inflight;
  service_options.max_layer_bytes = absl::GetFlag(FLAGS_max_layer_bytes);
  service_options.saved_step_ttl = absl::Seconds(absl::GetFlag(FLAGS_saved_step_ttl_s));
  service_options.checkpoint_root = checkpoint_root->get();
  service_options.auth = auth.get();
  service_options.stream_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_stream_idle_timeout_s));
  service_options.allow_client_shm = absl::GetFlag(FLAGS_allow_client_shm);
  service_options.shm_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_shm_idle_timeout_s));
  service_options.durable_store = durable_store.get();
  service_options.durable_every_steps = absl::GetFlag(FLAGS_durable_every_steps);
  service_options.durable_every = absl::Seconds(absl::GetFlag(FLAGS_durable_every_s));
  Metrics metrics;
  MoeServiceImpl service(service_options, &pool, &metrics);
  // Registered now, created and loaded by the first generation's setup, before SERVING.
  if (absl::Status restored = service.RestoreDurableLayers(); !restored.ok()) {
    std::fprintf(stderr, "moed: --state_dir: %s\n", restored.ToString().c_str());
    return 2;
  }
  RendezvousLimits rendezvous_limits;
  rendezvous_limits.max_bytes = absl::GetFlag(FLAGS_rendezvous_max_bytes);
  rendezvous_limits.max_keys = absl::GetFlag(FLAGS_rendezvous_max_keys);
  rendezvous_limits.max_waiting =
      static_cast<int>(std::min<int64_t>(absl::GetFlag(FLAGS_rendezvous_max_waiting), 1 << 20));
  rendezvous_limits.max_waiting_per_caller = static_cast<int>(
      std::min<int64_t>(absl::GetFlag(FLAGS_rendezvous_max_waiting_per_caller), 1 << 20));
  RendezvousStore rendezvous(rendezvous_limits);
  pool.set_on_new_generation([&](int64_t g) {
    rendezvous.DropGenerationsBefore(g);
    metrics.CountReformation();
  });
  CoordinatorService coordinator(&pool, &rendezvous, *secret);
  metrics.set_snapshot([&] {
    MetricsSnapshot now;
    now.serving = pool.serving();
    now.generation = pool.generation();
    now.worker_deaths = pool.worker_deaths();
    for (const v1::WorkerStatus& w : pool.WorkerStatuses()) {
      now.workers.push_back({w.rank(), w.alive(), w.memory_bytes()});
    }
    now.layers = service.LayerMetrics();
    return now;
  });

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // Two servers: the public API (health, reflection, MoeService; TLS and tokens) and the
  // internal plane (the Coordinator workers join through), each on its own address. A port
  // another process holds is an error at start, never shared (SO_REUSEPORT would let two
  // moeds answer the same port at random).
  grpc::ServerBuilder internal_builder;
  int internal_port = 0;
  const std::string internal_listen = absl::GetFlag(FLAGS_internal_listen);
  internal_builder.AddListeningPort(internal_listen, *internal_credentials, &internal_port);
  internal_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  internal_builder.RegisterService(&coordinator);
  std::unique_ptr<grpc::Server> internal_server = internal_builder.BuildAndStart();
  if (internal_server == nullptr || internal_port == 0) {
    std::fprintf(stderr, "moed: cannot listen on %s (--internal_listen; in use?)\n",
                 internal_listen.c_str());
    return 1;
  }
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::StrCat(listen, ":", absl::GetFlag(FLAGS_port)), *credentials,
                           &port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Bytes gRPC buffers for incoming messages of all calls at once (--max_inflight_bytes): past
  // it gRPC shrinks its flow-control windows and cancels streams (RESOURCE_EXHAUSTED). A
  // message over --max_message_bytes is refused with RESOURCE_EXHAUSTED.
  grpc::ResourceQuota quota("moed-public");
  quota.Resize(static_cast<size_t>(max_inflight));
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message));
  SetBulkTransportArgs(&builder);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    internal_server->Shutdown();
    std::fprintf(stderr, "moed: cannot listen on %s:%d (in use by another process?)\n",
                 listen.c_str(), absl::GetFlag(FLAGS_port));
    return 1;
  }
  // Readiness ("" and the service) follows the pool; "liveness" stays SERVING (server/health.h).
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  InitHealth(health, v1::MoeService::service_full_name());
  auto set_health = [health](bool serving) {
    SetReadiness(health, v1::MoeService::service_full_name(), serving);
  };
  pool.set_on_serving_changed(set_health);
  pool.set_on_setup([&](const WorkerSet& set) { return service.RecreateLayers(set); });
  pool.Start();
  // On every way out of Main: the pool's threads call into the service and the health
  // service (owned by the server), which are destroyed before the pool. Stop the RPCs first
  // (their handlers use the pool), then the pool's threads.
  struct StopFirst {
    grpc::Server* server;
    grpc::Server* internal_server;
    WorkerPool* pool;
    ~StopFirst() {
      const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
      server->Shutdown(deadline);
      internal_server->Shutdown(deadline);
      pool->Stop();
    }
  } stop_first{server.get(), internal_server.get(), &pool};

  std::unique_ptr<MetricsExposer> http;
  if (!absl::GetFlag(FLAGS_metrics_listen).empty()) {
    absl::StatusOr<std::unique_ptr<MetricsExposer>> started =
        MetricsExposer::Start(absl::GetFlag(FLAGS_metrics_listen), &metrics);
    if (!started.ok()) {
      std::fprintf(stderr, "moed: %s\n", started.status().ToString().c_str());
      return 1;
    }
    http = std::move(*started);
  }
  // The internal port first: whoever waits for the public port file finds both.
  WritePortFile(absl::GetFlag(FLAGS_internal_port_file), internal_port);
  WritePortFile(absl::GetFlag(FLAGS_port_file), port);
  std::fprintf(stderr, "moed: public API %s, %s; internal plane (%s) on %s (port %d)\n",
               tls.enabled() ? (tls.client_ca.empty() ? "TLS" : "mutual TLS") : "plaintext",
               auth ? absl::StrCat(auth->size(), " bearer token(s)").c_str()
                    : "no tokens file: every local caller is admin",
               InternalTlsFromFlags().enabled() ? "mutual TLS" : "plaintext",
               internal_listen.c_str(), internal_port);
  if (auth && !tls.enabled() && !IsLoopback(listen)) {
    std::fprintf(stderr,
                 "moed: WARNING: bearer tokens travel in plaintext beyond loopback; add "
                 "--tls_cert_file/--tls_key_file (docs/SECURITY.md)\n");
  }
  std::fprintf(stderr, "moed: checkpoints under %s\n", (*checkpoint_root)->path().c_str());
  std::fprintf(stderr, "moed: listening on %s:%d, %s %d worker(s)%s\n", listen.c_str(), port,
               embedded ? "starting" : "expecting", world,
               http ? absl::StrCat(", metrics on port ", http->port(), " (/metrics)").c_str() : "");

  std::unique_ptr<WorkerLauncher> launcher;
  int secret_fd = -1;  // embedded workers inherit it; open until moed exits
  if (embedded) {
    absl::StatusOr<int> memfd = secret->ToMemfd();
    if (!memfd.ok()) {
      std::fprintf(stderr, "moed: cluster secret: %s\n", memfd.status().ToString().c_str());
      return 1;
    }
    secret_fd = *memfd;
    launcher = std::make_unique<WorkerLauncher>(
        worker_binary, absl::StrCat("127.0.0.1:", internal_port), absl::GetFlag(FLAGS_device),
        world, absl::GetFlag(FLAGS_respawn_workers), InternalTlsFlagsForChild(), &pool, secret_fd,
        absl::GetFlag(FLAGS_worker_log_dir));
    absl::Status started = launcher->Start();
    if (!started.ok()) {
      std::fprintf(stderr, "moed: %s\n", started.ToString().c_str());
      return 1;
    }
  }

  int received = 0;
  while (sigwait(&signals, &received) == 0 && received == SIGHUP) {
    if (!auth) continue;
    absl::Status reloaded = auth->Reload();
    std::fprintf(stderr, "moed: SIGHUP: %s\n",
                 reloaded.ok()
                     ? absl::StrCat("reloaded ", auth->size(), " token(s)").c_str()
                     : absl::StrCat("kept the old tokens: ", reloaded.ToString()).c_str());
  }
  std::fprintf(stderr, "moed: signal %d, shutting down\n", received);
  set_health(false);
  if (launcher) launcher->Stop();
  return 0;  // stop_first shuts the server down and stops the pool
}

}  // namespace
}  // namespace moe

constexpr char kUsage[] = R"(the front end: serves moe.v1.MoeService and runs the moe-workers.

usage: moed [--workers=N | --expect_workers=N] [--device=cpu] [--port=50051] [flags]
  moed --workers=2 --device=cpu     embedded: starts 2 moe-workers next to itself
  moed --expect_workers=2           external: waits for 2 `moe-worker --frontend=HOST:50051`
)";

int main(int argc, char** argv) {
  moe::cli::ParseCommandLine(argc, argv, {"moed", kUsage, {"server/"}});
  return moe::Main();
}
