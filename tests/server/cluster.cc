#include "tests/server/cluster.h"

#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace moe {
namespace {

// stderr_path: the child's stderr is appended there (empty: inherited).
absl::StatusOr<pid_t> Spawn(std::vector<std::string> args, const std::string& stderr_path = "") {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    if (!stderr_path.empty()) {
      const int fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
      if (fd >= 0) dup2(fd, 2);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

void KillAndReap(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

absl::StatusOr<std::string> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& service) {
  grpc::GenericStub generic(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  // HealthCheckRequest{string service = 1}: empty for "", else tag 0x0a, length, bytes.
  std::string encoded;
  if (!service.empty()) {
    encoded = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  }
  grpc::Slice slice(encoded);
  grpc::ByteBuffer request(&slice, 1), response;
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                    &response, [&](grpc::Status s) {
                      status = s;
                      done.Notify();
                    });
  done.WaitForNotification();
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
    return absl::NotFoundError(status.error_message());
  }
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("bad health response");
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse{status = 1 (field 1, varint)}: SERVING = 1, NOT_SERVING = 2.
  if (bytes == std::string("\x08\x01", 2)) return std::string("SERVING");
  if (bytes == std::string("\x08\x02", 2)) return std::string("NOT_SERVING");
  return absl::StrCat("UNKNOWN(", bytes.size(), " bytes)");
}

}  // namespace

std::string TestClusterSecretFile() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  static int counter = 0;
  const std::string path =
      absl::StrCat(tmp ? tmp : "/tmp", "/cluster_secret_", getpid(), "_", counter++);
  std::ofstream(path) << "0123456789abcdef0123456789abcdef-" << path.size() << "\n";
  return path;
}

std::string RunfilePath(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return absl::StrCat(srcdir ? srcdir : ".", "/", workspace ? workspace : "moed", "/", path);
}

absl::StatusOr<std::unique_ptr<TestCluster>> TestCluster::Start(const ClusterOptions& options) {
  std::unique_ptr<TestCluster> cluster(new TestCluster());
  cluster->moed_path_ = RunfilePath("server/moed");
  cluster->worker_path_ = RunfilePath("server/moe-worker");
  const char* tmp = std::getenv("TEST_TMPDIR");
  static int counter = 0;
  const std::string port_file =
      absl::StrCat(tmp ? tmp : "/tmp", "/moed_port_", getpid(), "_", counter++);
  cluster->checkpoint_root_ =
      options.checkpoint_root.empty() ? port_file + ".checkpoints" : options.checkpoint_root;
  if (!options.embedded) {
    cluster->cluster_secret_ = absl::StrCat("test-cluster-secret-", getpid(), "-", counter,
                                            "-0123456789abcdef0123456789abcdef");
    cluster->cluster_secret_file_ = port_file + ".secret";
    std::ofstream(cluster->cluster_secret_file_) << cluster->cluster_secret_ << "\n";
  }
  std::vector<std::string> args = {cluster->moed_path_,
                                   "--port=0",
                                   "--listen=127.0.0.1",
                                   absl::StrCat("--port_file=", port_file),
                                   absl::StrCat("--internal_port_file=", port_file, ".internal"),
                                   absl::StrCat("--checkpoint_root=", cluster->checkpoint_root_),
                                   options.embedded
                                       ? absl::StrCat("--workers=", options.workers)
                                       : absl::StrCat("--expect_workers=", options.workers),
                                   "--heartbeat_ms=200",
                                   "--worker_dead_after_ms=1500",
                                   "--collective_timeout_ms=5000",
                                   "--step_timeout_ms=20000"};
  if (!options.embedded) {
    args.push_back(absl::StrCat("--cluster_secret_file=", cluster->cluster_secret_file_));
  }
  args.insert(args.end(), options.moed_flags.begin(), options.moed_flags.end());
  cluster->moed_args_ = std::move(args);
  cluster->moed_log_ = options.moed_log;
  cluster->port_file_ = port_file;
  if (absl::Status spawned = cluster->SpawnMoed(); !spawned.ok()) return spawned;
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(256 << 20);
  channel_args.SetMaxSendMessageSize(256 << 20);
  if (!options.tls_server_name.empty())
    channel_args.SetSslTargetNameOverride(options.tls_server_name);
  cluster->channel_ = grpc::CreateCustomChannel(
      cluster->address_,
      options.credentials ? options.credentials : grpc::InsecureChannelCredentials(), channel_args);
  cluster->stub_ = v1::MoeService::NewStub(cluster->channel_);
  cluster->workers_.assign(options.embedded ? 0 : options.workers, -1);
  cluster->worker_flags_ = options.worker_flags;
  for (int r = 0; r < static_cast<int>(cluster->workers_.size()); ++r) {
    absl::StatusOr<pid_t> pid = cluster->SpawnWorker(r);
    if (!pid.ok()) return pid.status();
    cluster->workers_[r] = *pid;
  }
  absl::Status serving = cluster->WaitServing(absl::Seconds(30));
  if (!serving.ok()) return serving;
  return cluster;
}

absl::Status TestCluster::SpawnMoed() {
  std::remove(port_file_.c_str());
  std::remove((port_file_ + ".internal").c_str());
  absl::StatusOr<pid_t> moed = Spawn(moed_args_, moed_log_);
  if (!moed.ok()) return moed.status();
  moed_ = *moed;
  int port = 0;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (port == 0) {
    std::ifstream in(port_file_);
    if (in >> port && port > 0) break;
    port = 0;
    if (absl::Now() > give_up) return absl::DeadlineExceededError("moed did not start");
    absl::SleepFor(absl::Milliseconds(20));
  }
  address_ = absl::StrCat("127.0.0.1:", port);
  // moed writes the internal port file before the public one.
  int internal_port = 0;
  if (!(std::ifstream(port_file_ + ".internal") >> internal_port) || internal_port <= 0) {
    return absl::InternalError("moed wrote no --internal_port_file");
  }
  internal_address_ = absl::StrCat("127.0.0.1:", internal_port);
  return absl::OkStatus();
}

absl::Status TestCluster::RestartMoed() {
  KillAndReap(moed_);
  moed_ = -1;
  // The same ports: flags given later win over "--port=0" and the default internal_listen.
  const std::string port = address_.substr(address_.rfind(':') + 1);
  const std::string pinned[] = {absl::StrCat("--port=", port),
                                absl::StrCat("--internal_listen=", internal_address_)};
  for (const std::string& flag : pinned) {
    if (std::find(moed_args_.begin(), moed_args_.end(), flag) == moed_args_.end()) {
      moed_args_.push_back(flag);
    }
  }
  return SpawnMoed();
}

absl::StatusOr<pid_t> TestCluster::SpawnWorker(int rank) {
  std::vector<std::string> args = {worker_path_,
                                   absl::StrCat("--frontend=", internal_address_),
                                   "--device=cpu",
                                   absl::StrCat("--rank=", rank),
                                   "--listen=127.0.0.1:0",
                                   "--advertise_host=127.0.0.1",
                                   "--rejoin_after_s=2",
                                   "--orphan_timeout_s=20",
                                   absl::StrCat("--cluster_secret_file=", cluster_secret_file_)};
  args.insert(args.end(), worker_flags_.begin(), worker_flags_.end());
  return Spawn(args);
}

TestCluster::~TestCluster() {
  for (pid_t pid : workers_) KillAndReap(pid);
  KillAndReap(moed_);
}

absl::StatusOr<std::string> HealthOf(const std::string& address, const std::string& service) {
  return CheckHealth(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), service);
}

absl::StatusOr<std::string> TestCluster::Health(const std::string& service) {
  return CheckHealth(channel_, service);
}

absl::Status TestCluster::WaitServing(absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (absl::Now() < give_up) {
    absl::StatusOr<std::string> health = Health();
    if (health.ok() && *health == "SERVING") return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError("cluster did not become SERVING");
}

absl::Status TestCluster::WaitNewGeneration(int64_t generation, absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (absl::Now() < give_up) {
    grpc::ClientContext context;
    v1::GetStatusResponse status;
    if (stub_->GetStatus(&context, v1::GetStatusRequest(), &status).ok() && status.serving() &&
        status.generation() > generation) {
      return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("no generation after ", generation, " became serving"));
}

bool TestCluster::KillWorker(int rank, int signal) {
  if (kill(workers_[rank], signal) != 0) return false;
  if (signal == SIGKILL) {
    waitpid(workers_[rank], nullptr, 0);
    workers_[rank] = -1;
  }
  if (signal != SIGSTOP) return true;
  // /proc/<pid>/stat: "pid (comm) S ...": the state letter follows the last ')'.
  const std::string stat_path = absl::StrCat("/proc/", workers_[rank], "/stat");
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (absl::Now() < give_up) {
    std::ifstream in(stat_path);
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'T') {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

absl::Status TestCluster::RestartWorker(int rank) {
  if (workers_[rank] > 0) KillAndReap(workers_[rank]);
  absl::StatusOr<pid_t> pid = SpawnWorker(rank);
  if (!pid.ok()) return pid.status();
  workers_[rank] = *pid;
  return absl::OkStatus();
}

bool TestCluster::MoedRunning() { return waitpid(moed_, nullptr, WNOHANG) == 0; }

void TestCluster::NotifyMoed(int signal) { kill(moed_, signal); }

int TestCluster::ReapMoed(absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  int status = 0;
  while (waitpid(moed_, &status, WNOHANG) == 0) {
    if (absl::Now() > give_up) {
      KillAndReap(moed_);
      moed_ = -1;
      return -2;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  moed_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int TestCluster::SignalMoed(int signal) {
  kill(moed_, signal);
  int status = 0;
  waitpid(moed_, &status, 0);
  moed_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace moe
