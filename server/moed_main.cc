// moed: the front end. Serves moe.v1.MoeService, grpc.health.v1.Health (readiness "" and
// "moe.v1.MoeService", liveness "liveness": server/health.h), server reflection and
// moe.internal.Coordinator on one port, and Prometheus metrics on --metrics_listen. SIGTERM /
// SIGINT stop it gracefully: readiness NOT_SERVING, new calls refused, every layer changed
// since its durable checkpoint written, within --shutdown_grace_s (server/graceful_stop.h).
//
//   moed --workers=2 --device=cpu --port=50051            # embedded: starts 2 moe-workers
//   moed --expect_workers=2 --internal_listen=0.0.0.0:50053 --cluster_secret_file=S
//   moe-worker --frontend=HOST:50053 --cluster_secret_file=S --device=cpu   # one per device
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "cli/usage.h"
#include "engine/file_util.h"
#include "engine/status_macros.h"
#include "server/auth.h"
#include "server/checkpoint_root.h"
#include "server/cluster_secret.h"
#include "server/coordinator_service.h"
#include "server/device.h"
#include "server/durable_store.h"
#include "server/engine_flags.h"
#include "server/graceful_stop.h"
#include "server/health.h"
#include "server/heap_trim.h"
#include "server/internal_tls.h"
#include "server/metrics.h"
#include "server/moe_service.h"
#include "server/moed_options.h"
#include "server/moed_util.h"
#include "server/ring_spin.h"
#include "server/rendezvous_store.h"
#include "server/tls.h"
#include "server/worker_launcher.h"
#include "server/worker_pool.h"
#include "transport/bulk_transport.h"

namespace moe {
namespace {

// What moed reads from files before it starts anything. Each error names its flag.
struct Loaded {
  std::string worker_binary;                 // embedded mode
  std::unique_ptr<TokenAuthenticator> auth;  // null without --tokens_file
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::optional<ClusterSecret> secret;
  std::shared_ptr<grpc::ServerCredentials> internal_credentials;
  std::unique_ptr<CheckpointRoot> checkpoint_root;
  std::unique_ptr<DurableStore> durable_store;  // null without an explicit --state_dir
};

absl::Status Prefixed(absl::string_view prefix, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

absl::StatusOr<Loaded> LoadFiles(const MoedOptions& options) {
  Loaded loaded;
  if (options.embedded) {
    ASSIGN_OR_RETURN(loaded.worker_binary, WorkerBinaryPath(options.worker_binary));
    if (!options.worker_log_dir.empty()) {
      absl::Status made = MakeDirectories(options.worker_log_dir);
      if (!made.ok()) return Prefixed("--worker_log_dir: ", made);
    }
  }
  if (!options.tokens_file.empty()) {
    ASSIGN_OR_RETURN(loaded.auth, TokenAuthenticator::Load(options.tokens_file));
  }
  ASSIGN_OR_RETURN(loaded.credentials, ServerCredentialsFromFiles(options.tls));
  absl::StatusOr<ClusterSecret> secret = options.cluster_secret_file.empty()
                                             ? ClusterSecret::Generate()
                                             : ClusterSecret::FromFile(options.cluster_secret_file);
  if (!secret.ok()) return Prefixed("--cluster_secret_file: ", secret.status());
  loaded.secret.emplace(std::move(*secret));
  // --internal_tls_*: the Coordinator's port and moed's calls to its workers speak mutual TLS.
  ASSIGN_OR_RETURN(loaded.internal_credentials, SetUpInternalTls(&*loaded.secret));
  absl::StatusOr<std::string> root_path =
      CheckpointRootPath(options.checkpoint_root, options.state_dir);
  absl::StatusOr<std::unique_ptr<CheckpointRoot>> root =
      root_path.ok() ? CheckpointRoot::Open(*root_path)
                     : absl::StatusOr<std::unique_ptr<CheckpointRoot>>(root_path.status());
  if (!root.ok()) return Prefixed("--checkpoint_root: ", root.status());
  loaded.checkpoint_root = std::move(*root);
  // Durable layers: only with an explicit --state_dir (the default folder keeps today's
  // behaviour: nothing survives a restart). A damaged store or one of another version is
  // refused here, before anything is loaded.
  if (!options.state_dir.empty()) {
    std::vector<std::string> cleaned;
    absl::StatusOr<std::unique_ptr<DurableStore>> opened =
        DurableStore::Open(AbsolutePath(options.state_dir) + "/layers", &cleaned);
    if (!opened.ok()) return Prefixed("--state_dir: ", opened.status());
    loaded.durable_store = std::move(*opened);
    for (const std::string& path : cleaned) {
      std::fprintf(stderr, "moed: --state_dir: removed leftover %s\n", path.c_str());
    }
    std::fprintf(stderr, "moed: durable layers in %s (%zu to restore)\n",
                 loaded.durable_store->path().c_str(), loaded.durable_store->layers().size());
  }
  return loaded;
}

// Blocks the shutdown signals (and SIGHUP, which reloads --tokens_file) in every thread; the
// main thread waits for them (WaitForShutdown).
sigset_t BlockShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// The gauges a scrape reads from the pool and the service.
void ConnectMetrics(Metrics* metrics, WorkerPool* pool, MoeServiceImpl* service) {
  metrics->set_snapshot([pool, service] {
    MetricsSnapshot now;
    now.serving = pool->serving();
    now.generation = pool->generation();
    now.worker_deaths = pool->worker_deaths();
    for (const v1::WorkerStatus& w : pool->WorkerStatuses()) {
      now.workers.push_back({w.rank(), w.alive(), w.memory_bytes()});
    }
    now.layers = service->LayerMetrics();
    now.reserved_worker_bytes = service->ReservedWorkerBytes();
    return now;
  });
}

// Two servers: the public API (health, reflection, MoeService; TLS and tokens) and the internal
// plane (the Coordinator workers join through), each on its own address. A port another
// process holds is an error at start, never shared (SO_REUSEPORT would let two moeds answer the
// same port at random). Null when the port cannot be bound.
std::unique_ptr<grpc::Server> StartInternalServer(const MoedOptions& options, const Loaded& loaded,
                                                  CoordinatorService* coordinator, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.internal_listen, loaded.internal_credentials, port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(coordinator);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  return *port == 0 ? nullptr : std::move(server);
}

std::unique_ptr<grpc::Server> StartPublicServer(const MoedOptions& options, const Loaded& loaded,
                                                MoeServiceImpl* service, int* port) {
  const int64_t max_message = options.service.max_message_bytes;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(options.listen, ":", options.port), loaded.credentials,
                           port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Bytes gRPC buffers for incoming messages of all calls at once (--max_inflight_bytes): past
  // it gRPC shrinks its flow-control windows and cancels streams (RESOURCE_EXHAUSTED). A
  // message over --max_message_bytes is refused with RESOURCE_EXHAUSTED.
  grpc::ResourceQuota quota("moed-public");
  quota.Resize(static_cast<size_t>(options.service.max_inflight_bytes));
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message));
  SetBulkTransportArgs(&builder);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  return *port == 0 ? nullptr : std::move(server);
}

void LogStartup(const MoedOptions& options, const Loaded& loaded, int internal_port, int port,
                const MetricsExposer* http) {
  std::fprintf(
      stderr, "moed: public API %s, %s; internal plane (%s) on %s (port %d)\n",
      options.tls.enabled() ? (options.tls.client_ca.empty() ? "TLS" : "mutual TLS") : "plaintext",
      loaded.auth ? absl::StrCat(loaded.auth->size(), " bearer token(s)").c_str()
                  : "no tokens file: every local caller is admin",
      InternalTlsFromFlags().enabled() ? "mutual TLS" : "plaintext",
      options.internal_listen.c_str(), internal_port);
  if (loaded.auth && !options.tls.enabled() && !IsLoopback(options.listen)) {
    std::fprintf(stderr,
                 "moed: WARNING: bearer tokens travel in plaintext beyond loopback; add "
                 "--tls_cert_file/--tls_key_file (docs/SECURITY.md)\n");
  }
  std::fprintf(stderr, "moed: checkpoints under %s\n", loaded.checkpoint_root->path().c_str());
  std::fprintf(stderr, "moed: listening on %s:%d, %s %d worker(s)%s\n", options.listen.c_str(),
               port, options.embedded ? "starting" : "expecting", options.world,
               http ? absl::StrCat(", metrics on port ", http->port(), " (/metrics)").c_str() : "");
}

// The Prometheus exporter on --metrics_listen; null without one, or when the default address
// is taken (logged: best effort, so that several moeds on one host do not fail on it). An
// address given with the flag that cannot be bound is an error.
absl::StatusOr<std::unique_ptr<MetricsExposer>> StartMetrics(const MoedOptions& options,
                                                             const Metrics* metrics) {
  if (options.metrics_listen.empty()) return nullptr;
  absl::StatusOr<std::unique_ptr<MetricsExposer>> started =
      MetricsExposer::Start(options.metrics_listen, metrics);
  if (started.ok() || options.metrics_listen_required) return started;
  std::fprintf(stderr,
               "moed: no metrics: the default --metrics_listen=%s is taken (%s); give "
               "--metrics_listen=HOST:PORT, or =off\n",
               options.metrics_listen.c_str(), std::string(started.status().message()).c_str());
  return nullptr;
}

// Embedded mode: the workers, handed the cluster secret through an inherited memfd that stays
// open until moed exits, and moed's internal TLS and engine flags (server/engine_flags.h).
absl::StatusOr<std::unique_ptr<WorkerLauncher>> StartWorkers(const MoedOptions& options,
                                                             const Loaded& loaded,
                                                             int internal_port, WorkerPool* pool) {
  RETURN_IF_ERROR(CheckEngineOptions(EngineOptionsFromFlags()));
  absl::StatusOr<int> secret_fd = loaded.secret->ToMemfd();
  if (!secret_fd.ok()) return Prefixed("cluster secret: ", secret_fd.status());
  std::vector<std::string> child_flags = InternalTlsFlagsForChild();
  for (std::string& flag : HeapRetainFlagsForChild()) child_flags.push_back(std::move(flag));
  for (std::string& flag : RingSpinFlagsForChild()) child_flags.push_back(std::move(flag));
  for (std::string& flag : EngineFlagsForChild()) child_flags.push_back(std::move(flag));
  auto launcher = std::make_unique<WorkerLauncher>(
      loaded.worker_binary, absl::StrCat("127.0.0.1:", internal_port), options.device,
      options.world, options.respawn_workers, std::move(child_flags), pool, *secret_fd,
      options.worker_log_dir);
  RETURN_IF_ERROR(launcher->Start());
  return launcher;
}

// Until SIGINT or SIGTERM; SIGHUP reloads the tokens file. Returns the signal.
int WaitForShutdown(const sigset_t& signals, TokenAuthenticator* auth, MoeServiceImpl* service) {
  int received = 0;
  while (sigwait(&signals, &received) == 0 && received == SIGHUP) {
    if (auth == nullptr) continue;
    absl::Status reloaded = auth->Reload();
    if (reloaded.ok()) service->CloseRevokedStepChannels();
    std::fprintf(stderr, "moed: SIGHUP: %s\n",
                 reloaded.ok()
                     ? absl::StrCat("reloaded ", auth->size(), " token(s)").c_str()
                     : absl::StrCat("kept the old tokens: ", reloaded.ToString()).c_str());
  }
  return received;
}

// The service's options: the flags' values plus what LoadFiles made (owned by `loaded`).
ServiceOptions ServiceOptionsFor(const MoedOptions& options, const Loaded& loaded) {
  ServiceOptions service_options = options.service;
  service_options.checkpoint_root = loaded.checkpoint_root.get();
  service_options.auth = loaded.auth.get();
  service_options.durable_store = loaded.durable_store.get();
  return service_options;
}

// Both servers, listening; the message of an error says which address could not be bound.
struct Servers {
  int internal_port = 0;
  int port = 0;
  std::unique_ptr<grpc::Server> internal;
  std::unique_ptr<grpc::Server> public_api;
};

absl::StatusOr<Servers> StartServers(const MoedOptions& options, const Loaded& loaded,
                                     CoordinatorService* coordinator, MoeServiceImpl* service) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  Servers servers;
  servers.internal = StartInternalServer(options, loaded, coordinator, &servers.internal_port);
  if (servers.internal == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.internal_listen,
                                               " (--internal_listen; in use?)"));
  }
  servers.public_api = StartPublicServer(options, loaded, service, &servers.port);
  if (servers.public_api == nullptr) {
    servers.internal->Shutdown();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen, ":",
                                               options.port, " (in use by another process?)"));
  }
  return servers;
}

// Readiness ("" and the service) follows the pool until the graceful stop ends it for good
// (server/health.h): a worker that comes back during the stop must not make moed ready again.
class Readiness {
 public:
  Readiness(grpc::Server* server, WorkerPool* pool) : health_(server->GetHealthCheckService()) {
    InitHealth(health_, v1::MoeService::service_full_name());
    pool->set_on_serving_changed([this](bool serving) { Set(serving); });
  }
  void Set(bool serving) {
    absl::MutexLock lock(&mu_);
    SetReadiness(health_, v1::MoeService::service_full_name(), serving && !stopped_);
  }
  void StopForGood() {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    SetReadiness(health_, v1::MoeService::service_full_name(), false);
  }

 private:
  grpc::HealthCheckServiceInterface* const health_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

// The graceful stop waits for `done`, a second SIGINT / SIGTERM or `deadline`: 0, the signal,
// or -1. SIGHUP is ignored meanwhile.
int WaitForDoneOrSignal(const sigset_t& signals, absl::Time deadline, absl::Notification* done) {
  while (!done->HasBeenNotified()) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return -1;
    const timespec wait = absl::ToTimespec(std::min(left, absl::Milliseconds(50)));
    const int received = sigtimedwait(&signals, nullptr, &wait);
    if (received == SIGINT || received == SIGTERM) return received;
  }
  return 0;
}

// After the first SIGINT / SIGTERM (server/graceful_stop.h): readiness NOT_SERVING first, new
// calls refused, the accepted ones finish, every changed layer is written. Returns 0 once
// every layer is done. At a second signal or once --shutdown_grace_s passed, moed exits at
// once with status 1 (std::_Exit: the threads still waiting for a layer's turn or writing it
// are abandoned; a durable write cut short leaves the layer's previous checkpoint whole).
// Either way the log names the layers persisted and those that were not.
int StopGracefully(int received, const MoedOptions& options, const sigset_t& signals,
                   MoeServiceImpl* service, Readiness* readiness) {
  const absl::Time deadline = absl::Now() + options.shutdown_grace;
  std::fprintf(stderr,
               "moed: signal %d: stopping: readiness NOT_SERVING, new calls refused; the running "
               "calls finish and changed layers are persisted within --shutdown_grace_s=%lld (a "
               "second signal exits at once)\n",
               received, static_cast<long long>(absl::ToInt64Seconds(options.shutdown_grace)));
  readiness->StopForGood();
  GracefulStopReport report;
  service->BeginShutdown(&report);
  absl::Notification done;
  std::thread persist([&] {
    service->PersistForShutdown(deadline, &report);
    done.Notify();
  });
  const int cut_short = WaitForDoneOrSignal(signals, deadline, &done);
  for (const std::string& line : report.Summary()) std::fprintf(stderr, "%s\n", line.c_str());
  if (cut_short == 0) {
    persist.join();
    return 0;
  }
  std::fprintf(
      stderr, "moed: stop: %s: exiting now with what is written\n",
      cut_short > 0 ? absl::StrCat("signal ", cut_short).c_str() : "--shutdown_grace_s passed");
  std::fflush(stderr);
  std::_Exit(1);
}

int Main() {
  const MoedOptions options = MoedOptionsFromFlags();
  if (absl::Status valid = ValidateMoedOptions(options); !valid.ok()) {
    std::fprintf(stderr, "moed: %s\n", std::string(valid.message()).c_str());
    return 2;
  }
  // Before any thread starts (LoadFiles may start gRPC's): a thread that did not block them
  // would take a SIGINT or SIGTERM that arrives while the graceful stop runs, and die of it.
  const sigset_t signals = BlockShutdownSignals();
  // Before any thread allocates: the free top of each thread's arena is bounded too.
  if (!BoundArenaTops()) std::fprintf(stderr, "moed: warning: mallopt refused the arena bound\n");
  absl::StatusOr<Loaded> loaded = LoadFiles(options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "moed: %s\n", loaded.status().ToString().c_str());
    return 2;
  }

  // Free heap memory above --heap_retain_bytes goes back to the system (server/heap_trim.h).
  HeapTrimmer heap_trimmer(HeapRetainBytes(/*cuda_worker=*/false));
  WorkerPool pool(options.pool, *loaded->secret);
  Metrics metrics;
  MoeServiceImpl service(ServiceOptionsFor(options, *loaded), &pool, &metrics);
  // Registered now, created and loaded by the first generation's setup, before SERVING.
  if (absl::Status restored = service.RestoreDurableLayers(); !restored.ok()) {
    std::fprintf(stderr, "moed: --state_dir: %s\n", restored.ToString().c_str());
    return 2;
  }
  RendezvousStore rendezvous(options.rendezvous);
  pool.set_on_new_generation([&](int64_t g) {
    rendezvous.DropGenerationsBefore(g);
    metrics.CountReformation();
  });
  CoordinatorService coordinator(&pool, &rendezvous, *loaded->secret);
  ConnectMetrics(&metrics, &pool, &service);

  absl::StatusOr<Servers> servers = StartServers(options, *loaded, &coordinator, &service);
  if (!servers.ok()) {
    std::fprintf(stderr, "moed: %s\n", std::string(servers.status().message()).c_str());
    return 1;
  }
  Readiness readiness(servers->public_api.get(), &pool);
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
  } stop_first{servers->public_api.get(), servers->internal.get(), &pool};

  absl::StatusOr<std::unique_ptr<MetricsExposer>> http = StartMetrics(options, &metrics);
  if (!http.ok()) {
    std::fprintf(stderr, "moed: %s\n", http.status().ToString().c_str());
    return 1;
  }
  // The internal port first: whoever waits for the public port file finds both.
  WritePortFile(options.internal_port_file, servers->internal_port);
  WritePortFile(options.port_file, servers->port);
  LogStartup(options, *loaded, servers->internal_port, servers->port, http->get());

  std::unique_ptr<WorkerLauncher> launcher;
  if (options.embedded) {
    absl::StatusOr<std::unique_ptr<WorkerLauncher>> started =
        StartWorkers(options, *loaded, servers->internal_port, &pool);
    if (!started.ok()) {
      std::fprintf(stderr, "moed: %s\n", started.status().ToString().c_str());
      return 1;
    }
    launcher = std::move(*started);
  }
  const int received = WaitForShutdown(signals, loaded->auth.get(), &service);
  const int status = StopGracefully(received, options, signals, &service, &readiness);
  if (launcher) launcher->Stop();
  std::fprintf(stderr, "moed: stopped\n");
  return status;  // stop_first shuts the server down and stops the pool
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
