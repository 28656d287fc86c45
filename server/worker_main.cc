// moe-worker: one process per device. Serves moe.internal.Worker and grpc.health.v1 (readiness
// "" and "moe.internal.Worker": joined and set up; liveness "liveness": server/health.h), joins
// the front end given by --frontend, then waits for the front end's Setup and per-layer calls.
//
// Every call to and from the front end carries the cluster secret (server/cluster_secret.h),
// over mutual TLS with the --internal_tls_* flags (server/internal_tls.h).
//
//   moe-worker --frontend=10.0.0.5:50053 --cluster_secret_file=/run/secrets/cluster_secret
//   moe-worker --frontend=10.0.0.5:50053 --cluster_secret_file=S --rank=1   # a restarted rank 1
#include <grpcpp/grpcpp.h>
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cli/usage.h"
#include "proto/status_convert.h"
#include "proto/worker.grpc.pb.h"
#include "server/authenticated_worker.h"
#include "server/cluster_secret.h"
#include "server/device.h"
#include "server/grpc_kv_store.h"
#include "server/health.h"
#include "server/heap_trim.h"
#include "server/internal_tls.h"
#include "server/socket_ifname.h"
#include "server/worker_options.h"
#include "server/worker_service.h"
#include "transport/bulk_transport.h"

namespace moe {
namespace {

std::string AdvertiseHost(const WorkerOptions& options) {
  if (!options.advertise_host.empty()) return options.advertise_host;
  std::string host = options.frontend.substr(0, options.frontend.rfind(':'));
  if (host == "localhost" || host == "127.0.0.1" || host == "[::1]") return "127.0.0.1";
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') return name;
  return "127.0.0.1";
}

// Readiness (server/health.h): set up, and pinged within --rejoin_after_s (5 s if 0). Updated
// when a Setup begins or ends and by the watchdog (pings stopping).
class Readiness {
 public:
  Readiness(const WorkerService* service, absl::Duration unpinged)
      : service_(service), unpinged_(unpinged) {}
  // Once the server runs: from now on changes reach `health`.
  void Attach(grpc::HealthCheckServiceInterface* health) {
    absl::MutexLock lock(&mu_);
    health_ = health;
    InitHealth(health, internal::Worker::service_full_name());
  }
  void Update() {
    absl::MutexLock lock(&mu_);
    const bool ready = service_->ready() && absl::Now() - service_->last_ping() <= unpinged_;
    if (health_ != nullptr && ready != was_ready_) {
      SetReadiness(health_, internal::Worker::service_full_name(), ready);
      was_ready_ = ready;
    }
  }

 private:
  const WorkerService* const service_;
  const absl::Duration unpinged_;
  absl::Mutex mu_;
  grpc::HealthCheckServiceInterface* health_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool was_ready_ ABSL_GUARDED_BY(mu_) = false;
};

// This worker's own port; null when it cannot be bound (a taken port fails the start).
std::unique_ptr<grpc::Server> StartServer(const WorkerOptions& options,
                                          const std::shared_ptr<grpc::ServerCredentials>& creds,
                                          grpc::Service* service, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, creds, port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(INT_MAX);
  builder.SetMaxSendMessageSize(INT_MAX);
  SetBulkTransportArgs(&builder);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  return *port == 0 ? nullptr : std::move(server);
}

// Join requests to the front end's Coordinator.
class Joiner {
 public:
  Joiner(const WorkerOptions& options, std::shared_ptr<grpc::Channel> channel, std::string address)
      : options_(options),
        coordinator_(internal::Coordinator::NewStub(std::move(channel))),
        address_(std::move(address)) {}

  grpc::Status JoinOnce(int rank, internal::JoinResponse* joined) {
    internal::JoinRequest join;
    join.set_requested_rank(rank);
    join.set_address(address_);
    join.set_device(options_.device);
    join.set_pid(getpid());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return coordinator_->Join(&context, join, joined);
  }

  // Joins under --rank, retrying while the front end is not up yet (--join_timeout_s).
  grpc::Status Join(internal::JoinResponse* joined) {
    const absl::Time give_up = absl::Now() + options_.join_timeout;
    while (true) {
      grpc::Status status = JoinOnce(options_.rank, joined);
      if (status.ok()) return status;
      const bool retry = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                         status.error_code() == grpc::StatusCode::ABORTED;
      if (!retry || absl::Now() > give_up) return status;
      absl::SleepFor(absl::Milliseconds(200));
    }
  }

 private:
  const WorkerOptions& options_;
  std::unique_ptr<internal::Coordinator::Stub> coordinator_;
  const std::string address_;
};

// Watchdog, until the front end asks this worker to shut down: a worker the front end stopped
// pinging (declared dead after a stall, or a restarted front end) joins again under its rank;
// one whose front end stays gone exits. It also notices readiness lost to missing pings.
void Watchdog(const WorkerOptions& options, int rank, WorkerService* service, Joiner* joiner,
              Readiness* readiness) {
  absl::Time last_attempt = absl::InfinitePast();
  const absl::Duration rejoin = options.rejoin_after;
  const absl::Duration orphan = options.orphan_timeout;
  while (!service->HasShutdownRequest()) {
    absl::SleepFor(absl::Milliseconds(200));
    readiness->Update();
    const absl::Duration silent = absl::Now() - service->last_ping();
    if (orphan > absl::ZeroDuration() && silent > orphan) {
      std::fprintf(stderr, "moe-worker: no contact with the front end for %ds, exiting\n",
                   static_cast<int>(absl::ToInt64Seconds(orphan)));
      _exit(3);
    }
    if (rejoin > absl::ZeroDuration() && silent > rejoin &&
        absl::Now() - last_attempt > absl::Seconds(1)) {
      last_attempt = absl::Now();
      internal::JoinResponse again;
      if (joiner->JoinOnce(rank, &again).ok()) {
        std::fprintf(stderr, "moe-worker: rejoined as rank %d\n", again.rank());
        service->NoteContact();
      }
    }
  }
}

int Main(const WorkerOptions& options) {
  if (absl::Status valid = ValidateWorkerOptions(options); !valid.ok()) {
    std::fprintf(stderr, "moe-worker: %s\n", std::string(valid.message()).c_str());
    return 2;
  }
  // --socket_ifname: NCCL_SOCKET_IFNAME set here, before any thread runs, and Gloo's interface.
  std::string socket_iface;
  if (!options.socket_ifname.empty()) {
    absl::StatusOr<std::string> iface = UseSocketIfname(options.socket_ifname);
    if (!iface.ok()) {
      std::fprintf(stderr, "moe-worker: %s\n", iface.status().ToString().c_str());
      return 2;
    }
    socket_iface = *iface;
    std::fprintf(stderr, "moe-worker: --socket_ifname=%s: NCCL_SOCKET_IFNAME=%s, Gloo on %s\n",
                 options.socket_ifname.c_str(), options.socket_ifname.c_str(),
                 !options.engine.gloo.iface.empty()      ? options.engine.gloo.iface.c_str()
                 : !options.engine.gloo.hostname.empty() ? options.engine.gloo.hostname.c_str()
                                                         : socket_iface.c_str());
  }
  absl::StatusOr<ClusterSecret> secret = options.cluster_secret_fd >= 0
                                             ? ClusterSecret::FromFd(options.cluster_secret_fd)
                                             : ClusterSecret::FromFile(options.cluster_secret_file);
  if (!secret.ok()) {
    std::fprintf(stderr, "moe-worker: %s\n", secret.status().ToString().c_str());
    return 2;
  }
  // --internal_tls_*: this worker's port and its calls to moed speak mutual TLS.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = SetUpInternalTls(&*secret);
  if (!credentials.ok()) {
    std::fprintf(stderr, "moe-worker: %s\n", credentials.status().ToString().c_str());
    return 2;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT_MAX);
  args.SetMaxSendMessageSize(INT_MAX);
  // Join and the rendezvous store's calls carry the secret.
  std::shared_ptr<grpc::Channel> channel = secret->Channel(options.frontend, args);
  auto store = std::make_shared<GrpcKeyValueStore>(channel);
  // Free heap memory above --heap_retain_bytes goes back to the system (server/heap_trim.h).
  HeapTrimmer heap_trimmer(HeapRetainBytes(/*cuda_worker=*/options.device != "cpu"));
  // Gloo listens where peers can reach this worker: on --gloo_iface or --gloo_hostname if
  // given, else on the interface --socket_ifname selects, else on the advertised host.
  const std::string host = AdvertiseHost(options);
  EngineOptions engine = options.engine;
  if (engine.gloo.iface.empty() && engine.gloo.hostname.empty()) {
    engine.gloo.iface = socket_iface;
    if (socket_iface.empty()) engine.gloo.hostname = host;
  }
  WorkerService service(options.device, store, engine);
  AuthenticatedWorkerService authenticated(&service, *secret, options.ring_spin);
  Readiness readiness(&service, options.rejoin_after > absl::ZeroDuration() ? options.rejoin_after
                                                                            : absl::Seconds(5));
  service.set_on_ready_changed([&readiness] { readiness.Update(); });

  int port = 0;
  std::unique_ptr<grpc::Server> server = StartServer(options, *credentials, &authenticated, &port);
  if (server == nullptr) {
    std::fprintf(stderr, "moe-worker: cannot listen on %s\n", options.listen.c_str());
    return 1;
  }
  readiness.Attach(server->GetHealthCheckService());
  const std::string address = absl::StrCat(host, ":", port);

  Joiner joiner(options, channel, address);
  internal::JoinResponse joined;
  grpc::Status join = joiner.Join(&joined);
  if (!join.ok()) {
    std::fprintf(stderr, "moe-worker: join %s failed: %s\n", options.frontend.c_str(),
                 join.error_message().c_str());
    return 1;
  }
  std::fprintf(stderr, "moe-worker: rank %d of %d at %s (front end %s, device %s)\n", joined.rank(),
               joined.world_size(), address.c_str(), options.frontend.c_str(),
               options.device.c_str());
  service.NoteContact();

  std::thread watchdog(Watchdog, std::cref(options), joined.rank(), &service, &joiner, &readiness);
  service.WaitForShutdownRequest();
  // Server::Shutdown cancels the calls still open at its deadline but then waits for their
  // bodies to finish, and a body stuck in a collective ends only at its timeout (and layers
  // may be held by such calls): wait for the shutdown a little past its deadline, then exit.
  absl::Notification server_stopped;
  std::thread([&] {
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_stopped.Notify();
  }).detach();
  server_stopped.WaitForNotificationWithTimeout(absl::Seconds(3));
  watchdog.join();
  std::fflush(stderr);
  _exit(0);
}

}  // namespace
}  // namespace moe

constexpr char kUsage[] = R"(one worker per device: joins moed and runs its share of the experts.

usage: moe-worker --frontend=HOST:PORT [--device=cpu] [--rank=R] [flags]
  (moed --workers=N starts its workers itself; start them by hand for moed --expect_workers=N)
)";

int main(int argc, char** argv) {
  moe::cli::ParseCommandLine(argc, argv, {"moe-worker", kUsage, {"server/"}});
  // GPU devices: keep freed heap memory in the process. Every step allocates and frees the same
  // large host buffers (request/response bytes, x/out/d_out/d_x tensors). glibc serves blocks
  // over its mmap threshold with mmap and unmaps them on free, so each step page-faults (and the
  // kernel zeroes) them again: milliseconds per step at these sizes (history/PERFORMANCE-2026-11-29_12-03.md,
  // GPU "API vs device"). M_MMAP_THRESHOLD cannot be raised past 32 MiB on 64-bit glibc, below a
  // step's tensors, hence M_MMAP_MAX = 0 (no mmap'd blocks; glibc still maps requests no heap
  // can hold) and no trimming of the heap top. The price: RSS stays at the worker's high-water
  // mark (of each of glibc's arenas: bounded by --heap_retain_bytes, 4 GiB by default here,
  // server/heap_trim.h). Not on the CPU device: there the layer's
  // scratch lives on the same heap, and engine_bench ran its qwen3 step 8% slower with these
  // settings (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=-1) than with glibc's defaults.
  const moe::WorkerOptions options = moe::WorkerOptionsFromFlags();
  if (options.device != "cpu") {
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, -1);
  } else if (!moe::BoundArenaTops()) {  // the CPU device: each arena's free top bounded
    std::fprintf(stderr, "moe-worker: warning: mallopt refused the arena bound\n");
  }
  return moe::Main(options);
}
