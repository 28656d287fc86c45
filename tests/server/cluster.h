// Test harness: a real moed front end and real moe-worker processes on localhost.
//
//   ASSIGN_OR_RETURN(auto cluster, TestCluster::Start({.workers = 2}));
//   v1::MoeService::Stub* stub = cluster->stub();
//   cluster->KillWorker(1, SIGKILL);
//   RETURN_IF_ERROR(cluster->RestartWorker(1));
//   RETURN_IF_ERROR(cluster->WaitServing(absl::Seconds(30)));
//
// moed runs in external mode (--expect_workers) so the test owns the worker processes and
// can kill and restart them; the binaries come from the test's runfiles.
#ifndef MOED_TESTS_SERVER_CLUSTER_H_
#define MOED_TESTS_SERVER_CLUSTER_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/moe.grpc.pb.h"

namespace moe {

struct ClusterOptions {
  int workers = 2;
  std::vector<std::string> moed_flags;    // extra flags, e.g. "--max_saved_steps=2"
  std::vector<std::string> worker_flags;  // extra flags of the workers the test starts
  // moed starts its own workers (--workers=N) instead of the test starting them.
  bool embedded = false;
  // moed's stderr is appended to this file (empty: the test's stderr).
  std::string moed_log;
  // moed's --checkpoint_root; empty: a fresh folder in the test's temporary directory.
  std::string checkpoint_root;
  // Credentials of the test's channel (stub(), health); null: plaintext. With TLS, the name
  // the server certificate is checked against.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string tls_server_name;
};

class TestCluster {
 public:
  static absl::StatusOr<std::unique_ptr<TestCluster>> Start(const ClusterOptions& options);
  ~TestCluster();  // SIGKILLs everything it started

  v1::MoeService::Stub* stub() { return stub_.get(); }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  std::string address() const { return address_; }
  // moed's internal plane (--internal_listen): the Coordinator workers join through.
  std::string internal_address() const { return internal_address_; }
  // moed's --checkpoint_root (absolute; created by moed at start).
  const std::string& checkpoint_root() const { return checkpoint_root_; }
  // The cluster secret moed and the workers share (a file in the test's temporary directory,
  // --cluster_secret_file); empty in embedded mode (moed generates its own).
  const std::string& cluster_secret() const { return cluster_secret_; }

  // Polls grpc.health.v1 until SERVING or the timeout.
  absl::Status WaitServing(absl::Duration timeout);
  // Polls GetStatus until moed serves a generation after `generation` (a re-formation
  // finished) or the timeout.
  absl::Status WaitNewGeneration(int64_t generation, absl::Duration timeout);
  // grpc.health.v1.Health/Check of `service` ("" = the whole server): "SERVING",
  // "NOT_SERVING", or an error (NOT_FOUND: unknown service).
  absl::StatusOr<std::string> Health(const std::string& service = "");

  // Sends `signal` to the worker spawned as `rank`. SIGKILL: also reaps it. SIGSTOP: also waits
  // (up to 5 s) until the kernel shows it stopped, so that no call it receives afterwards is
  // answered; false if it did not stop.
  bool KillWorker(int rank, int signal);
  absl::Status RestartWorker(int rank);
  // SIGKILLs moed and starts it again with the same flags on the same public and internal
  // ports, so the test's channels and the running workers (which rejoin by themselves) find
  // the new instance. Returns once it listens; WaitServing waits for the workers.
  absl::Status RestartMoed();
  bool MoedRunning();
  // Sends `signal` to moed; with wait, reaps it and returns its exit status (-1 if signalled).
  int SignalMoed(int signal);
  // Sends `signal` to moed and returns at once (SIGHUP: reload the tokens file).
  void NotifyMoed(int signal);
  // Waits up to `timeout` for moed to exit, reaps it and returns its exit status (-1 if
  // signalled); -2 when it still ran (then it is SIGKILLed).
  int ReapMoed(absl::Duration timeout);
  pid_t worker_pid(int rank) const { return workers_[rank]; }
  pid_t moed_pid() const { return moed_; }

 private:
  TestCluster() = default;
  absl::StatusOr<pid_t> SpawnWorker(int rank);
  // Spawns moed with moed_args_ and waits for its port files.
  absl::Status SpawnMoed();

  std::vector<std::string> moed_args_;
  std::string moed_log_;
  std::string port_file_;
  std::string moed_path_;
  std::string worker_path_;
  std::string address_;
  std::string internal_address_;
  std::string checkpoint_root_;
  std::string cluster_secret_;
  std::string cluster_secret_file_;
  pid_t moed_ = -1;
  std::vector<pid_t> workers_;
  std::vector<std::string> worker_flags_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::MoeService::Stub> stub_;
};

// grpc.health.v1.Health/Check of `service` at `address` (moed or a moe-worker), as Health.
absl::StatusOr<std::string> HealthOf(const std::string& address, const std::string& service);

// A fresh cluster secret file in the test's temporary directory (for moed or moe-worker
// processes a test starts itself: --cluster_secret_file=<it>).
std::string TestClusterSecretFile();

// Runfiles path of a binary of this workspace ("server/moed").
std::string RunfilePath(const std::string& path);

}  // namespace moe

#endif  // MOED_TESTS_SERVER_CLUSTER_H_
