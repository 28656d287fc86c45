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
#include "server/bulk_transport.h"
#include "server/cluster_secret.h"
#include "server/device.h"
#include "server/grpc_kv_store.h"
#include "server/health.h"
#include "server/internal_tls.h"
#include "server/worker_service.h"

ABSL_FLAG(std::string, frontend, "",
          "host:port of moed's internal plane (moed --internal_listen; required)");
ABSL_FLAG(std::string, cluster_secret_file, "",
          "file holding the cluster secret the front end was given (moed "
          "--cluster_secret_file); required unless --cluster_secret_fd");
ABSL_FLAG(int, cluster_secret_fd, -1,
          "embedded mode (set by moed): inherited file descriptor holding the cluster secret");
ABSL_FLAG(std::string, device, "cpu", "device this worker runs on: cpu");
ABSL_FLAG(int, rank, -1, "rank to ask for (-1: any free rank)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "address of this worker's own gRPC service (port 0: pick a free one); loopback by "
          "default, an interface's address (or 0.0.0.0) when peers are on other hosts");
ABSL_FLAG(std::string, advertise_host, "",
          "host name or address the front end and peers reach this worker at (empty: "
          "127.0.0.1 when --frontend is on localhost, else this host's name)");
ABSL_FLAG(int, cpu_threads, 0,
          "cpu device: threads of the element-wise kernels (0: one per hardware thread); "
          "OpenBLAS follows OPENBLAS_NUM_THREADS");
ABSL_FLAG(int, join_timeout_s, 60, "give up when the front end does not accept the join");
ABSL_FLAG(int, rejoin_after_s, 5,
          "join again (same rank) when the front end has not pinged for this long: it "
          "declared this worker dead, or it restarted");
ABSL_FLAG(int, orphan_timeout_s, 60,
          "exit when the front end has neither pinged nor accepted a join for this long "
          "(0: never)");

namespace moe {
namespace {

std::string AdvertiseHost(const std::string& frontend) {
  if (!absl::GetFlag(FLAGS_advertise_host).empty()) return absl::GetFlag(FLAGS_advertise_host);
  std::string host = frontend.substr(0, frontend.rfind(':'));
  if (host == "localhost" || host == "127.0.0.1" || host == "[::1]") return "127.0.0.1";
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') return name;
  return "127.0.0.1";
}

int Main() {
  const std::string frontend = absl::GetFlag(FLAGS_frontend);
  const std::string device = absl::GetFlag(FLAGS_device);
  if (frontend.empty()) {
    std::fprintf(stderr, "moe-worker: --frontend=HOST:PORT is required\n");
    return 2;
  }
  absl::Status device_ok = CheckDeviceFlag(device);
  if (!device_ok.ok()) {
    std::fprintf(stderr, "moe-worker: %s\n", device_ok.ToString().c_str());
    return 2;
  }
  const int secret_fd = absl::GetFlag(FLAGS_cluster_secret_fd);
  const std::string secret_file = absl::GetFlag(FLAGS_cluster_secret_file);
  if ((secret_fd >= 0) == !secret_file.empty()) {
    std::fprintf(stderr,
                 "moe-worker: give the cluster secret with --cluster_secret_file=PATH (the file "
                 "moed was given with its own --cluster_secret_file)\n");
    return 2;
  }
  absl::StatusOr<ClusterSecret> secret =
      secret_fd >= 0 ? ClusterSecret::FromFd(secret_fd) : ClusterSecret::FromFile(secret_file);
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
  std::shared_ptr<grpc::Channel> channel = secret->Channel(frontend, args);
  auto store = std::make_shared<GrpcKeyValueStore>(channel);
  WorkerService service(device, store, absl::GetFlag(FLAGS_cpu_threads));
  AuthenticatedWorkerService authenticated(&service, *secret);
  // Readiness (server/health.h): set up, and pinged within --rejoin_after_s (5 s if 0).
  // Updated when a Setup begins or ends and by the watchdog below (pings stopping).
  const int rejoin_s = absl::GetFlag(FLAGS_rejoin_after_s);
  const absl::Duration unpinged = absl::Seconds(rejoin_s > 0 ? rejoin_s : 5);
  grpc::HealthCheckServiceInterface* health = nullptr;
  absl::Mutex readiness_mu;
  bool was_ready = false;
  auto update_readiness = [&] {
    absl::MutexLock lock(&readiness_mu);
    const bool ready = service.ready() && absl::Now() - service.last_ping() <= unpinged;
    if (health != nullptr && ready != was_ready) {
      SetReadiness(health, internal::Worker::service_full_name(), ready);
      was_ready = ready;
    }
  };
  service.set_on_ready_changed(update_readiness);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), *credentials, &port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a taken port fails the start
  builder.SetMaxReceiveMessageSize(INT_MAX);
  builder.SetMaxSendMessageSize(INT_MAX);
  SetBulkTransportArgs(&builder);
  builder.RegisterService(&authenticated);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "moe-worker: cannot listen on %s\n", absl::GetFlag(FLAGS_listen).c_str());
    return 1;
  }
  {
    absl::MutexLock lock(&readiness_mu);
    health = server->GetHealthCheckService();
    InitHealth(health, internal::Worker::service_full_name());
  }
  const std::string host = AdvertiseHost(frontend);
  const std::string address = absl::StrCat(host, ":", port);
  // Gloo listens where peers can reach this worker: the advertised host, unless the operator
  // chose an interface or name for Gloo explicitly.
  if (std::getenv("MOED_GLOO_IFACE") == nullptr && std::getenv("MOED_GLOO_HOSTNAME") == nullptr) {
    setenv("MOED_GLOO_HOSTNAME", host.c_str(), /*overwrite=*/0);
  }

  auto coordinator = internal::Coordinator::NewStub(channel);
  auto join_once = [&](int rank, internal::JoinResponse* joined) {
    internal::JoinRequest join;
    join.set_requested_rank(rank);
    join.set_address(address);
    join.set_device(device);
    join.set_pid(getpid());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return coordinator->Join(&context, join, joined);
  };

  // Join, retrying while the front end is not up yet.
  internal::JoinResponse joined;
  const absl::Time give_up = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s));
  while (true) {
    grpc::Status status = join_once(absl::GetFlag(FLAGS_rank), &joined);
    if (status.ok()) break;
    const bool retry = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                       status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                       status.error_code() == grpc::StatusCode::ABORTED;
    if (!retry || absl::Now() > give_up) {
      std::fprintf(stderr, "moe-worker: join %s failed: %s\n", frontend.c_str(),
                   status.error_message().c_str());
      return 1;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  std::fprintf(stderr, "moe-worker: rank %d of %d at %s (front end %s, device %s)\n", joined.rank(),
               joined.world_size(), address.c_str(), frontend.c_str(), device.c_str());
  service.NoteContact();

  // Watchdog: a worker the front end stopped pinging (declared dead after a stall, or a
  // restarted front end) joins again under its rank; one whose front end stays gone exits.
  const int orphan_s = absl::GetFlag(FLAGS_orphan_timeout_s);
  const int rank = joined.rank();
  // It also notices readiness lost to missing pings.
  std::thread watchdog([&] {
    absl::Time last_attempt = absl::InfinitePast();
    while (!service.HasShutdownRequest()) {
      absl::SleepFor(absl::Milliseconds(200));
      update_readiness();
      const absl::Duration silent = absl::Now() - service.last_ping();
      if (orphan_s > 0 && silent > absl::Seconds(orphan_s)) {
        std::fprintf(stderr, "moe-worker: no contact with the front end for %ds, exiting\n",
                     orphan_s);
        _exit(3);
      }
      if (rejoin_s > 0 && silent > absl::Seconds(rejoin_s) &&
          absl::Now() - last_attempt > absl::Seconds(1)) {
        last_attempt = absl::Now();
        internal::JoinResponse again;
        grpc::Status status = join_once(rank, &again);
        if (status.ok()) {
          std::fprintf(stderr, "moe-worker: rejoined as rank %d\n", again.rank());
          service.NoteContact();
        }
      }
    }
  });
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
  // kernel zeroes) them again: milliseconds per step at these sizes (docs/PERFORMANCE.md, GPU
  // "API vs device"). M_MMAP_THRESHOLD cannot be raised past 32 MiB on 64-bit glibc, below a
  // step's tensors, hence M_MMAP_MAX = 0 (no mmap'd blocks; glibc still maps requests no heap
  // can hold) and no trimming of the heap top. The price: RSS stays at the worker's high-water
  // mark, which every step reaches again anyway. Not on the CPU device: there the layer's
  // scratch lives on the same heap, and engine_bench ran its qwen3 step 8% slower with these
  // settings (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=-1) than with glibc's defaults.
  if (absl::GetFlag(FLAGS_device) != "cpu") {
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, -1);
  }
  return moe::Main();
}
