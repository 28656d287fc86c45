// moed with a tokens file + 2 real moe-worker processes: a data-parallel run belongs to the
// identity that opened it (server/data_parallel_steps.h). Another token naming the run is
// PERMISSION_DENIED and cannot complete its step; one caller's pending run never holds up
// another caller's run on the same layer; num_ranks is bounded by --max_dp_ranks.
#include <chrono>
#include <fstream>
#include <future>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "tests/server/cluster_fixture.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

class DataParallelOwnerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string tokens = ::testing::TempDir() + "/dp_owner_tokens";
    std::ofstream(tokens) << Sha256Hex("alice-token") << " train alice\n"
                          << Sha256Hex("bob-token") << " train bob\n"
                          << Sha256Hex("admin-token") << " admin ops\n";
    ClusterOptions options;
    options.moed_flags = {"--tokens_file=" + tokens, "--metrics_listen=off",
                          "--dp_step_timeout_ms=20000"};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
    grpc::ClientContext ctx;
    As(&ctx, "admin-token");
    v1::CreateLayerRequest request;
    request.set_name("shared");
    *request.mutable_config() = TinyConfig(21);
    v1::CreateLayerResponse response;
    grpc::Status s = cluster_->stub()->CreateLayer(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  static void As(grpc::ClientContext* ctx, const std::string& token, int deadline_ms = 20000) {
    ctx->AddMetadata("authorization", "Bearer " + token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
  }
  static v1::ApplyOptimizerRequest StepRequest(const std::string& run, int rank, int64_t step,
                                               int num_ranks = 2) {
    v1::ApplyOptimizerRequest request;
    request.set_layer("shared");
    request.mutable_sgd()->set_lr(0.1);
    request.set_num_ranks(num_ranks);
    request.set_rank(rank);
    request.set_step(step);
    request.set_run_id(run);
    return request;
  }
  struct Answer {
    grpc::Status status;
    v1::ApplyOptimizerResponse response;
  };
  static Answer Apply(const std::string& token, const v1::ApplyOptimizerRequest& request,
                      int deadline_ms = 20000) {
    grpc::ClientContext ctx;
    As(&ctx, token, deadline_ms);
    Answer answer;
    answer.status = cluster_->stub()->ApplyOptimizer(&ctx, request, &answer.response);
    return answer;
  }
  static std::future<Answer> ApplyAsync(const std::string& token,
                                        const v1::ApplyOptimizerRequest& request,
                                        int deadline_ms = 20000) {
    return std::async(std::launch::async, [=] { return Apply(token, request, deadline_ms); });
  }

  static inline TestCluster* cluster_ = nullptr;
};

TEST_F(DataParallelOwnerTest, AnotherTokenCannotCompleteARun) {
  std::future<Answer> alice0 = ApplyAsync("alice-token", StepRequest("alice-run", 0, 0));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  Answer bob = Apply("bob-token", StepRequest("alice-run", 1, 0));
  EXPECT_EQ(bob.status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << bob.status.error_message();
  EXPECT_THAT(bob.status.error_message(), HasSubstr("another caller"));
  // Bob's rank did not count: alice's step still waits for her own rank 1.
  EXPECT_EQ(alice0.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  Answer alice1 = Apply("alice-token", StepRequest("alice-run", 1, 0));
  ASSERT_TRUE(alice1.status.ok()) << alice1.status.error_message();
  Answer waited = alice0.get();
  ASSERT_TRUE(waited.status.ok()) << waited.status.error_message();
  EXPECT_EQ(waited.response.optimizer_step(), alice1.response.optimizer_step());
}

TEST_F(DataParallelOwnerTest, APendingRunNeverBlocksAnotherCallersRun) {
  // Another caller declares 1024 ranks and sends one: its step stays pending (for
  // --dp_step_timeout_ms; this test's call gives up after 3 s).
  std::future<Answer> pending =
      ApplyAsync("admin-token", StepRequest("wide-run", 0, 0, /*num_ranks=*/1024), 3000);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Bob's own run on the same layer steps at once.
  std::future<Answer> bob0 = ApplyAsync("bob-token", StepRequest("bob-run", 0, 0));
  Answer bob1 = Apply("bob-token", StepRequest("bob-run", 1, 0), 5000);
  ASSERT_TRUE(bob1.status.ok()) << bob1.status.error_message();
  Answer bob_waited = bob0.get();
  ASSERT_TRUE(bob_waited.status.ok()) << bob_waited.status.error_message();
  EXPECT_EQ(pending.get().status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST_F(DataParallelOwnerTest, NumRanksIsBoundedByMaxDpRanks) {
  Answer wide = Apply("alice-token", StepRequest("alice-huge", 0, 0, /*num_ranks=*/1025));
  EXPECT_EQ(wide.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << wide.status.error_message();
  EXPECT_THAT(wide.status.error_message(), HasSubstr("--max_dp_ranks"));
}

}  // namespace
}  // namespace moe
