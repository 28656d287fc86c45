// Embedded mode: moed starts its own moe-worker processes (one per rank), notices when one
// exits (the pool marks it dead at once instead of waiting for missed pings) and, unless told
// not to, starts a replacement that rejoins under the same rank.
//
// Each worker inherits the cluster secret through a copy of `secret_fd` (a memfd,
// ClusterSecret::ToMemfd) whose number it gets as --cluster_secret_fd: the secret itself is
// never on a command line or in a file.
//
//   WorkerLauncher launcher(WorkerBinaryPath(flag), "127.0.0.1:50051", "cpu", 2, ...);
//   RETURN_IF_ERROR(launcher.Start());
//   ...
//   launcher.Stop();  // SIGTERM, then SIGKILL after a grace period
//
// With a log directory, each worker's output goes to <dir>/worker-<rank>.log instead of
// moed's stderr.
#ifndef MOED_SERVER_WORKER_LAUNCHER_H_
#define MOED_SERVER_WORKER_LAUNCHER_H_

#include <sys/types.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/worker_pool.h"

namespace moe {

// flag_value if set, else "moe-worker" next to this executable (/proc/self/exe), which holds
// for bazel-bin/server/ and for an install directory alike.
absl::StatusOr<std::string> WorkerBinaryPath(const std::string& flag_value);

class WorkerLauncher {
 public:
  // log_dir: when set, worker r's stdout and stderr are appended to <log_dir>/worker-<r>.log
  // (a restarted worker continues its rank's file); otherwise they go to moed's own.
  // secret_fd: close-on-exec; owned by the caller, open until Stop().
  WorkerLauncher(std::string binary, std::string frontend, std::string device, int count,
                 bool respawn, std::vector<std::string> extra_args, WorkerPool* pool, int secret_fd,
                 std::string log_dir = "");
  ~WorkerLauncher();

  absl::Status Start();
  void Stop();

 private:
  absl::StatusOr<pid_t> Spawn(int rank);
  void ReapLoop();

  const std::string binary_;
  const std::string frontend_;
  const std::string device_;
  const int count_;
  const bool respawn_;
  const std::vector<std::string> extra_args_;
  WorkerPool* const pool_;
  const int secret_fd_;
  const std::string log_dir_;

  absl::Mutex mu_;
  std::vector<pid_t> pids_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_LAUNCHER_H_
