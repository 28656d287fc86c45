// Embedded mode: `moed --workers=2` starts its own moe-worker processes (found next to its
// own executable), restarts one that dies, and stops them all on SIGTERM.
#include <signal.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

bool ProcessExists(int64_t pid) { return kill(static_cast<pid_t>(pid), 0) == 0; }

TEST(EmbeddedTest, StartsRespawnsAndStopsItsWorkers) {
  ClusterOptions options;
  options.embedded = true;
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

}  // namespace
}  // namespace moe
