// moe-worker's flags and the checks of their values (server/worker_options.h).
#include "server/worker_options.h"

#include "absl/flags/flag.h"
#include "server/device.h"
#include "server/engine_flags.h"
#include "server/ring_spin.h"
#include "server/socket_ifname.h"

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
ABSL_FLAG(std::string, socket_ifname, "",
          "the network interface of this worker's peer traffic, in NCCL_SOCKET_IFNAME's "
          "conventions (eth0; a prefix list ib,eth; =eth0 exact; ^docker,lo excludes): NCCL's "
          "(the worker sets NCCL_SOCKET_IFNAME) and Gloo's (the first such interface, unless "
          "--gloo_iface or --gloo_hostname); empty: NCCL's own choice, Gloo on "
          "--advertise_host");
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

WorkerOptions WorkerOptionsFromFlags() {
  WorkerOptions o;
  o.frontend = absl::GetFlag(FLAGS_frontend);
  o.cluster_secret_file = absl::GetFlag(FLAGS_cluster_secret_file);
  o.cluster_secret_fd = absl::GetFlag(FLAGS_cluster_secret_fd);
  o.device = absl::GetFlag(FLAGS_device);
  o.rank = absl::GetFlag(FLAGS_rank);
  o.listen = absl::GetFlag(FLAGS_listen);
  o.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  o.socket_ifname = absl::GetFlag(FLAGS_socket_ifname);
  o.engine = EngineOptionsFromFlags();
  o.engine.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  o.ring_spin = RingSpinFromFlag();
  o.join_timeout = absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s));
  o.rejoin_after = absl::Seconds(absl::GetFlag(FLAGS_rejoin_after_s));
  o.orphan_timeout = absl::Seconds(absl::GetFlag(FLAGS_orphan_timeout_s));
  return o;
}

absl::Status ValidateWorkerOptions(const WorkerOptions& o) {
  if (o.frontend.empty()) return absl::InvalidArgumentError("--frontend=HOST:PORT is required");
  absl::Status device_ok = CheckDeviceFlag(o.device);
  if (!device_ok.ok()) return device_ok;
  if ((o.cluster_secret_fd >= 0) == !o.cluster_secret_file.empty()) {
    return absl::InvalidArgumentError(
        "give the cluster secret with --cluster_secret_file=PATH (the file moed was given with "
        "its own --cluster_secret_file)");
  }
  if (!o.socket_ifname.empty()) {
    if (absl::Status ifname = CheckSocketIfname(o.socket_ifname); !ifname.ok()) return ifname;
  }
  if (absl::Status spin = CheckRingSpin(o.ring_spin); !spin.ok()) return spin;
  return CheckEngineOptions(o.engine);
}

}  // namespace moe
