// Embedded mode: `moed --workers=2` starts its own moe-worker processes (found next to its
// own executable), restarts one that dies, and stops them all on SIGTERM; with
// --worker_log_dir their output goes to worker-<rank>.log there.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

bool ProcessExists(int64_t pid) { return kill(static_cast<pid_t>(pid), 0) == 0; }

// The whole file at `path` ("" when it cannot be read).
std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(EmbeddedTest, StartsRespawnsAndStopsItsWorkers) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string log_dir = absl::StrCat(tmp ? tmp : "/tmp", "/worker_logs_", getpid());
  ClusterOptions options;
  options.embedded = true;
  options.moed_flags = {absl::StrCat("--worker_log_dir=", log_dir)};
  auto started = TestCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<TestCluster> cluster = std::move(*started);

  auto status = [&] {
    grpc::ClientContext ctx;
    v1::GetStatusResponse response;
    EXPECT_TRUE(cluster->stub()->GetStatus(&ctx, v1::GetStatusRequest(), &response).ok());
    return response;
  };
  {
    grpc::ClientContext ctx;
    v1::CreateLayerRequest request;
    request.set_name("e");
    *request.mutable_config() = TinyConfig(3);
    v1::CreateLayerResponse response;
    ASSERT_TRUE(cluster->stub()->CreateLayer(&ctx, request, &response).ok());
  }
  auto forward = [&] {
    grpc::ClientContext ctx;
    v1::ForwardRequest request;
    request.set_layer("e");
    *request.mutable_x() = FloatsToProto({10, 32}, RandomFloats(320, 1));
    v1::ForwardResponse response;
    return cluster->stub()->Forward(&ctx, request, &response);
  };
  ASSERT_TRUE(forward().ok());

  v1::GetStatusResponse before = status();
  ASSERT_EQ(before.workers_size(), 2);
  const int64_t victim = before.workers(1).pid();
  ASSERT_GT(victim, 0);
  kill(static_cast<pid_t>(victim), SIGKILL);
  // moed notices the exit, starts a replacement that rejoins as rank 1, layers come back.
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(cluster->WaitServing(absl::Seconds(30)).ok());
  v1::GetStatusResponse after = status();
  EXPECT_NE(after.workers(1).pid(), victim);
  EXPECT_GT(after.generation(), before.generation());
  EXPECT_TRUE(forward().ok());

  // --worker_log_dir: one file per rank; the restarted rank 1 appended to its file.
  EXPECT_EQ(Count(ReadFileOrEmpty(log_dir + "/worker-0.log"), "moe-worker: rank 0 of 2"), 1);
  EXPECT_EQ(Count(ReadFileOrEmpty(log_dir + "/worker-1.log"), "moe-worker: rank 1 of 2"), 2);

  // SIGTERM: moed exits 0 and takes its workers with it.
  EXPECT_EQ(cluster->SignalMoed(SIGTERM), 0);
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (absl::Now() < give_up &&
         (ProcessExists(after.workers(0).pid()) || ProcessExists(after.workers(1).pid()))) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_FALSE(ProcessExists(after.workers(0).pid()));
  EXPECT_FALSE(ProcessExists(after.workers(1).pid()));
}

// Timing flags must be positive: 0 made the heartbeat loop spin (--heartbeat_ms), declared
// every worker dead at once (--worker_dead_after_ms) or failed every step (--step_timeout_ms),
// with moed running on as if configured. It must refuse to start instead (exit 2).
TEST(EmbeddedTest, RefusesNonPositiveTimingFlags) {
  const std::string moed = RunfilePath("server/moed");
  const std::string secret = TestClusterSecretFile();  // so that only `flag` is wrong
  for (const char* flag :
       {"--heartbeat_ms=0", "--ping_timeout_ms=0", "--worker_dead_after_ms=0",
        "--step_timeout_ms=0", "--collective_timeout_ms=-1", "--setup_timeout_ms=0"}) {
    // --expect_workers: nothing is started; `timeout` ends a moed that does not refuse.
    const std::string command = absl::StrCat("timeout 5 ", moed, " --port=0 --listen=127.0.0.1 ",
                                             "--expect_workers=1 --cluster_secret_file=", secret,
                                             " ", flag, " 2>/dev/null");
    const int status = std::system(command.c_str());
    ASSERT_TRUE(WIFEXITED(status)) << flag;
    EXPECT_EQ(WEXITSTATUS(status), 2) << flag;
  }
}

// External workers need the cluster secret from a file moed shares with them: without
// --cluster_secret_file, --expect_workers refuses to start (exit 2) and says what to give.
TEST(EmbeddedTest, ExternalModeNeedsAClusterSecretFile) {
  const std::string log = ::testing::TempDir() + "/no_secret.log";
  const std::string command =
      absl::StrCat("timeout 5 ", RunfilePath("server/moed"),
                   " --port=0 --listen=127.0.0.1 --expect_workers=1 2>", log);
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  std::ifstream in(log);
  const std::string said((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(said.find("--cluster_secret_file"), std::string::npos) << said;
}

// Metrics bind 127.0.0.1:9090 by default, best effort: with that port taken (several moeds on one
// host) moed logs it and serves on; an address given with --metrics_listen that is taken stops
// moed (exit 1).
TEST(EmbeddedTest, DefaultMetricsPortTakenIsNotFatalAGivenOneIs) {
  // Hold 9090 on loopback ourselves, unless something on this host already does.
  const int holder = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(9090);
  if (bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) listen(holder, 1);
  const std::string moed = RunfilePath("server/moed");
  const std::string secret = TestClusterSecretFile();
  const std::string port_file = ::testing::TempDir() + "/metrics_default.port";
  const std::string base = absl::StrCat(moed, " --port=0 --listen=127.0.0.1 --expect_workers=1 ",
                                        "--cluster_secret_file=", secret);
  // Still running when `timeout` ends it (124), and listening.
  int status = std::system(
      absl::StrCat("timeout 3 ", base, " --port_file=", port_file, " 2>/dev/null").c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 124);
  EXPECT_TRUE(std::ifstream(port_file).good());
  // A given port that another socket holds (one we bound, port picked by the kernel).
  const int taken = socket(AF_INET, SOCK_STREAM, 0);
  addr.sin_port = 0;
  ASSERT_EQ(bind(taken, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  listen(taken, 1);
  socklen_t len = sizeof(addr);
  getsockname(taken, reinterpret_cast<sockaddr*>(&addr), &len);
  status =
      std::system(absl::StrCat("timeout 5 ", base,
                               " --metrics_listen=127.0.0.1:", ntohs(addr.sin_port), " 2>/dev/null")
                      .c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  close(taken);
  close(holder);
}

}  // namespace
}  // namespace moe
