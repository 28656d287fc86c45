// grpc.health.v1 on moed and moe-worker (server/health.h): readiness ("" and the service name)
// follows the cluster / the worker's setup, while "liveness" stays SERVING as long as the
// process runs, so liveness probes never restart a process that recovers by itself.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>

#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/cluster_fixture.h"

namespace moe {
namespace {

// Polls `check` until it returns `want` (or 10 s passed); returns the last answer.
std::string WaitFor(const std::function<absl::StatusOr<std::string>()>& check,
                    const std::string& want) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  std::string last;
  while (true) {
    absl::StatusOr<std::string> got = check();
    last = got.ok() ? *got : got.status().ToString();
    if (last == want || absl::Now() > give_up) return last;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

TEST(HealthTest, FrontEndLivenessOutlivesReadiness) {
  auto started = TestCluster::Start(ClusterOptions{});
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<TestCluster> cluster = std::move(*started);
  EXPECT_EQ(*cluster->Health(""), "SERVING");
  EXPECT_EQ(*cluster->Health("moe.v1.MoeService"), "SERVING");
  EXPECT_EQ(*cluster->Health("liveness"), "SERVING");
  EXPECT_EQ(cluster->Health("no.such.Service").status().code(), absl::StatusCode::kNotFound);

  // A lost worker: the cluster is not ready, the front end is still alive.
  cluster->KillWorker(1, SIGKILL);
  EXPECT_EQ(WaitFor([&] { return cluster->Health(""); }, "NOT_SERVING"), "NOT_SERVING");
  EXPECT_EQ(*cluster->Health("moe.v1.MoeService"), "NOT_SERVING");
  EXPECT_EQ(*cluster->Health("liveness"), "SERVING");

  ASSERT_TRUE(cluster->RestartWorker(1).ok());
  ASSERT_TRUE(cluster->WaitServing(absl::Seconds(30)).ok());
  EXPECT_EQ(*cluster->Health("moe.v1.MoeService"), "SERVING");
  EXPECT_EQ(*cluster->Health("liveness"), "SERVING");
}

TEST(HealthTest, WorkerReadyWhileSetUpAndPinged) {
  auto started = TestCluster::Start(ClusterOptions{});
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<TestCluster> cluster = std::move(*started);
  grpc::ClientContext ctx;
  v1::GetStatusResponse status;
  ASSERT_TRUE(cluster->stub()->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
  ASSERT_EQ(status.workers_size(), 2);
  for (const v1::WorkerStatus& w : status.workers()) {
    const std::string address = w.address();
    SCOPED_TRACE(address);
    EXPECT_EQ(WaitFor([&] { return HealthOf(address, ""); }, "SERVING"), "SERVING");
    EXPECT_EQ(*HealthOf(address, "moe.internal.Worker"), "SERVING");
    EXPECT_EQ(*HealthOf(address, "liveness"), "SERVING");
  }

  // The front end is gone: no more pings, so after --rejoin_after_s (2 s here) the workers
  // are no longer ready, but they are alive (rejoining).
  EXPECT_EQ(cluster->SignalMoed(SIGKILL), -1);
  for (const v1::WorkerStatus& w : status.workers()) {
    const std::string address = w.address();
    SCOPED_TRACE(address);
    EXPECT_EQ(WaitFor([&] { return HealthOf(address, ""); }, "NOT_SERVING"), "NOT_SERVING");
    EXPECT_EQ(*HealthOf(address, "moe.internal.Worker"), "NOT_SERVING");
    EXPECT_EQ(*HealthOf(address, "liveness"), "SERVING");
  }
}

TEST(HealthTest, WorkerNotReadyBeforeJoining) {
  // A worker whose front end does not answer: it serves gRPC (liveness) but is not ready.
  const std::string address = absl::StrCat("127.0.0.1:", FreePort());
  const std::string frontend = absl::StrCat("127.0.0.1:", FreePort());  // nobody listens
  std::vector<std::string> args = {RunfilePath("server/moe-worker"),
                                   absl::StrCat("--frontend=", frontend),
                                   "--device=cpu",
                                   absl::StrCat("--listen=", address),
                                   "--join_timeout_s=30",
                                   "--cluster_secret_file=" + TestClusterSecretFile()};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execv(argv[0], argv.data());
    _exit(127);
  }
  EXPECT_EQ(WaitFor([&] { return HealthOf(address, "liveness"); }, "SERVING"), "SERVING");
  EXPECT_EQ(*HealthOf(address, ""), "NOT_SERVING");
  EXPECT_EQ(*HealthOf(address, "moe.internal.Worker"), "NOT_SERVING");
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

}  // namespace
}  // namespace moe
