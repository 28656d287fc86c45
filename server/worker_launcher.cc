#include "server/worker_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<std::string> WorkerBinaryPath(const std::string& flag_value) {
  std::string path = flag_value;
  if (path.empty()) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) return absl::InternalError("cannot read /proc/self/exe");
    self[n] = '\0';
    std::string dir(self);
    dir = dir.substr(0, dir.rfind('/'));
    path = dir + "/moe-worker";
  }
  if (access(path.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("--worker_binary: ", path,
                                            " is not an executable file (", strerror(errno), ")"));
  }
  return path;
}

WorkerLauncher::WorkerLauncher(std::string binary, std::string frontend, std::string device,
                               int count, bool respawn, std::vector<std::string> extra_args,
                               WorkerPool* pool, int secret_fd, std::string log_dir)
    : binary_(std::move(binary)),
      frontend_(std::move(frontend)),
      device_(std::move(device)),
      count_(count),
      respawn_(respawn),
      extra_args_(std::move(extra_args)),
      pool_(pool),
      secret_fd_(secret_fd),
      log_dir_(std::move(log_dir)) {}

WorkerLauncher::~WorkerLauncher() { Stop(); }

absl::StatusOr<pid_t> WorkerLauncher::Spawn(int rank) {
  // Local CPU workers share the host's cores: each gets its part (kernels and OpenBLAS).
  const int share = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / count_);
  std::vector<std::string> args = {
      binary_, absl::StrCat("--frontend=", frontend_), absl::StrCat("--device=", device_),
      absl::StrCat("--rank=", rank), absl::StrCat("--cluster_secret_fd=", secret_fd_)};
  if (device_ == "cpu") args.push_back(absl::StrCat("--cpu_threads=", share));
  // The environment is built before fork: between fork and exec only async-signal-safe
  // calls are allowed (moed has other threads).
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  if (device_ == "cpu" && std::getenv("OPENBLAS_NUM_THREADS") == nullptr) {
    env.push_back(absl::StrCat("OPENBLAS_NUM_THREADS=", share));
  }
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  args.insert(args.end(), extra_args_.begin(), extra_args_.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The log file is opened here (close-on-exec: other threads may fork too); the child moves
  // it onto its stdout and stderr.
  int log_fd = -1;
  if (!log_dir_.empty()) {
    const std::string path = absl::StrCat(log_dir_, "/worker-", rank, ".log");
    log_fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("--worker_log_dir: cannot open ", path, ": ", strerror(errno)));
    }
  }
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    if (log_fd >= 0) close(log_fd);
    return absl::InternalError(absl::StrCat("fork: ", strerror(err)));
  }
  if (pid == 0) {
    // Child: die with moed; signals moed blocks must not stay blocked in the worker.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_UNBLOCK, &all, nullptr);
    if (log_fd >= 0 && (dup2(log_fd, STDOUT_FILENO) < 0 || dup2(log_fd, STDERR_FILENO) < 0)) {
      _exit(126);
    }
    // The secret's memfd is close-on-exec in moed; this child alone keeps its copy. The
    // worker reads it with pread (the offset is shared with moed and earlier workers).
    if (fcntl(secret_fd_, F_SETFD, 0) != 0) _exit(125);

    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  if (log_fd >= 0) close(log_fd);
  return pid;
}

absl::Status WorkerLauncher::Start() {
  absl::MutexLock lock(&mu_);
  pids_.assign(count_, -1);
  for (int r = 0; r < count_; ++r) {
    absl::StatusOr<pid_t> pid = Spawn(r);
    if (!pid.ok()) return pid.status();
    pids_[r] = *pid;
  }
  reaper_ = std::thread([this] { ReapLoop(); });
  return absl::OkStatus();
}

void WorkerLauncher::ReapLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(100))) return;
    }
    // Only our own workers are waited for (waitpid(-1) would also reap children that other
    // parts of the process fork and wait for themselves).
    int status = 0;
    pid_t pid = -1;
    int rank = -1;
    {
      absl::MutexLock lock(&mu_);
      for (int r = 0; r < count_ && rank < 0; ++r) {
        if (pids_[r] > 0 && waitpid(pids_[r], &status, WNOHANG) == pids_[r]) {
          pid = pids_[r];
          rank = r;
          pids_[r] = -1;
        }
      }
    }
    if (rank < 0) continue;
    const std::string why =
        WIFSIGNALED(status)
            ? absl::StrCat("process ", pid, " killed by signal ", WTERMSIG(status))
            : absl::StrCat("process ", pid, " exited with status ", WEXITSTATUS(status));
    std::fprintf(stderr, "moed: worker %d %s\n", rank, why.c_str());
    pool_->MarkDead(rank, why);
    if (!respawn_) continue;
    absl::SleepFor(absl::Seconds(1));  // no tight loop when a worker cannot start at all
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    absl::StatusOr<pid_t> replacement = Spawn(rank);
    if (replacement.ok()) {
      pids_[rank] = *replacement;
    } else {
      std::fprintf(stderr, "moed: cannot restart worker %d: %s\n", rank,
                   replacement.status().ToString().c_str());
    }
  }
}

void WorkerLauncher::Stop() {
  std::vector<pid_t> pids;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    pids = pids_;
  }
  if (reaper_.joinable()) reaper_.join();
  for (pid_t pid : pids) {
    if (pid > 0) kill(pid, SIGTERM);
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(3);
  for (pid_t pid : pids) {
    if (pid <= 0) continue;
    while (waitpid(pid, nullptr, WNOHANG) == 0) {
      if (absl::Now() > give_up) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
}

}  // namespace moe
