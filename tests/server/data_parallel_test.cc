// moed + 2 real moe-worker processes: data-parallel ApplyOptimizer steps (num_ranks > 1,
// server/data_parallel_steps.h). Two "ranks" (threads of this test) share one layer: the
// optimizer runs once per step on the mean of their gradients, a repeated call does not step
// again, a rank that never comes ends the step after --dp_step_timeout_ms, bad fields are
// INVALID_ARGUMENT.
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster_fixture.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr int kStepTimeoutMs = 1500;  // moed's --dp_step_timeout_ms here: the tests stay fast

class DataParallelTest : public ClusterTest {
 protected:
  static void SetUpTestSuite() {
    ClusterOptions options;
    options.workers = 2;
    options.moed_flags = {absl::StrCat("--dp_step_timeout_ms=", kStepTimeoutMs),
                          "--metrics_listen=off"};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }

  static v1::ApplyOptimizerRequest StepRequest(const std::string& layer, int rank, int64_t step,
                                               const std::string& run = "run-a", int num_ranks = 2,
                                               double lr = 0.1) {
    v1::ApplyOptimizerRequest request;
    request.set_layer(layer);
    request.mutable_sgd()->set_lr(lr);
    request.set_num_ranks(num_ranks);
    request.set_rank(rank);
    request.set_step(step);
    request.set_run_id(run);
    return request;
  }
  grpc::Status Apply(const v1::ApplyOptimizerRequest& request, v1::ApplyOptimizerResponse* response,
                     int deadline_ms = 20000) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    return stub()->ApplyOptimizer(&ctx, request, response);
  }
  struct Answer {
    grpc::Status status;
    v1::ApplyOptimizerResponse response;
  };
  // The call on a thread of its own (a rank that waits for the others).
  std::future<Answer> ApplyAsync(const v1::ApplyOptimizerRequest& request,
                                 int deadline_ms = 20000) {
    return std::async(std::launch::async, [this, request, deadline_ms] {
      Answer answer;
      answer.status = Apply(request, &answer.response, deadline_ms);
      return answer;
    });
  }
  // Forward + Backward of one rank's batch; d_out scaled by `scale`, and d_aux, d_z_loss too.
  void ForwardBackward(const std::string& layer, uint32_t seed, float scale) {
    v1::Tensor x = FloatsToProto({6, 32}, RandomFloats(6 * 32, seed));
    std::vector<float> d = RandomFloats(6 * 32, seed + 100);
    for (float& v : d) v *= scale;
    v1::ForwardResponse fwd;
    ASSERT_TRUE(Forward(layer, x, true, &fwd).ok());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::BackwardRequest request;
    request.set_layer(layer);
    request.set_step_id(fwd.step_id());
    *request.mutable_d_out() = FloatsToProto({6, 32}, d);
    request.set_d_aux(scale);
    request.set_d_z_loss(scale);
    v1::BackwardResponse bwd;
    ASSERT_TRUE(stub()->Backward(&ctx, request, &bwd).ok());
  }
};

TEST_F(DataParallelTest, TwoRanksStepOnceOnTheMeanOfTheirGradients) {
  ASSERT_TRUE(Create("dp", TinyConfig(7)).ok());
  ASSERT_TRUE(Create("single", TinyConfig(7)).ok());
  // Two ranks' batches into "dp"; the same batches into "single" with every loss gradient
  // halved: the gradient of the mean loss over the global batch, as one process computes it.
  // Halving is exact in fp32, so the two layers must end bit-identical.
  for (int step = 0; step < 2; ++step) {
    ForwardBackward("dp", 1 + 2 * step, 1.0f);
    ForwardBackward("dp", 2 + 2 * step, 1.0f);
    ForwardBackward("single", 1 + 2 * step, 0.5f);
    ForwardBackward("single", 2 + 2 * step, 0.5f);
    std::future<Answer> rank1 = ApplyAsync(StepRequest("dp", 1, step));
    v1::ApplyOptimizerResponse rank0;
    ASSERT_TRUE(Apply(StepRequest("dp", 0, step), &rank0).ok());
    Answer other = rank1.get();
    ASSERT_TRUE(other.status.ok()) << other.status.error_message();
    EXPECT_EQ(rank0.optimizer_step(), step + 1);  // one optimizer step per training step
    EXPECT_EQ(other.response.optimizer_step(), step + 1);
    EXPECT_FALSE(rank0.already_applied());
    EXPECT_FALSE(other.response.already_applied());
    v1::ApplyOptimizerRequest plain;
    plain.set_layer("single");
    plain.mutable_sgd()->set_lr(0.1);
    v1::ApplyOptimizerResponse single;
    ASSERT_TRUE(Apply(plain, &single).ok());
  }
  std::map<std::string, std::vector<float>> dp = Weights("dp", false);
  std::map<std::string, std::vector<float>> single = Weights("single", false);
  ASSERT_EQ(dp.size(), single.size());
  for (const auto& [name, values] : single) {
    EXPECT_EQ(MaxRelError(dp[name], values), 0.0) << name;
  }
  // The step consumed the gradients of both ranks.
  for (const auto& [name, values] : Weights("dp", true)) {
    for (float v : values) ASSERT_EQ(v, 0.0f) << name;
  }
}

TEST_F(DataParallelTest, RepeatedCallsDoNotStepAgain) {
  ASSERT_TRUE(Create("repeat", TinyConfig(3)).ok());
  ForwardBackward("repeat", 5, 1.0f);
  // Rank 0 gives up waiting, then calls again: it counts once, so its second call still waits
  // for rank 1, and the step happens once.
  v1::ApplyOptimizerResponse response;
  grpc::Status first = Apply(StepRequest("repeat", 0, 10), &response, /*deadline_ms=*/300);
  EXPECT_EQ(first.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  std::future<Answer> again = ApplyAsync(StepRequest("repeat", 0, 10));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_EQ(again.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  ASSERT_TRUE(Apply(StepRequest("repeat", 1, 10), &response).ok());
  EXPECT_EQ(response.optimizer_step(), 1);
  Answer waited = again.get();
  ASSERT_TRUE(waited.status.ok()) << waited.status.error_message();
  EXPECT_EQ(waited.response.optimizer_step(), 1);

  // A repeat of the applied step answers what was recorded and changes nothing.
  const std::map<std::string, std::vector<float>> before = Weights("repeat", false);
  ForwardBackward("repeat", 6, 1.0f);  // gradients a new step would use
  for (int rank : {1, 0}) {
    ASSERT_TRUE(Apply(StepRequest("repeat", rank, 10), &response).ok());
    EXPECT_TRUE(response.already_applied());
    EXPECT_EQ(response.optimizer_step(), 1);
  }
  EXPECT_EQ(Weights("repeat", false), before);
  // An older step that was never applied cannot be applied after a newer one.
  grpc::Status older = Apply(StepRequest("repeat", 0, 9), &response);
  EXPECT_EQ(older.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(older.error_message(), HasSubstr("older"));
}

TEST_F(DataParallelTest, ARankThatNeverComesEndsTheStep) {
  ASSERT_TRUE(Create("missing", TinyConfig(4)).ok());
  ForwardBackward("missing", 8, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  v1::ApplyOptimizerResponse response;
  grpc::Status alone = Apply(StepRequest("missing", 0, 1, "run-m", 3), &response);
  const double waited_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(alone.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(alone.error_message(), HasSubstr("missing ranks: 1, 2"));
  EXPECT_GE(waited_ms, kStepTimeoutMs - 100);
  EXPECT_LT(waited_ms, kStepTimeoutMs + 5000);
  // Nothing was stepped, and the layer is not stuck: the step gathers anew, and a plain step
  // or another run is served at once.
  v1::GetLayerRequest get;
  get.set_name("missing");
  v1::GetLayerResponse info;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub()->GetLayer(&ctx, get, &info).ok());
  EXPECT_EQ(info.layer().optimizer_step(), 0);
  std::future<Answer> r1 = ApplyAsync(StepRequest("missing", 1, 1, "run-m", 2));
  ASSERT_TRUE(Apply(StepRequest("missing", 0, 1, "run-m", 2), &response).ok());
  ASSERT_TRUE(r1.get().status.ok());
  EXPECT_EQ(response.optimizer_step(), 1);
  v1::ApplyOptimizerRequest plain;
  plain.set_layer("missing");
  plain.mutable_sgd()->set_lr(0.1);
  ASSERT_TRUE(Apply(plain, &response, 5000).ok());
  EXPECT_EQ(response.optimizer_step(), 2);
}

TEST_F(DataParallelTest, InvalidFieldsAndMismatchedRanks) {
  ASSERT_TRUE(Create("fields", TinyConfig(5)).ok());
  v1::ApplyOptimizerResponse response;
  auto expect_invalid = [&](v1::ApplyOptimizerRequest request, const char* field) {
    grpc::Status s = Apply(request, &response, 5000);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_THAT(s.error_message(), HasSubstr(field));
  };
  expect_invalid(StepRequest("fields", 0, 0, "r", -1), "num_ranks");
  expect_invalid(StepRequest("fields", 0, 0, "r", 5000), "num_ranks");
  expect_invalid(StepRequest("fields", 2, 0), "rank");
  expect_invalid(StepRequest("fields", -1, 0), "rank");
  expect_invalid(StepRequest("fields", 0, -1), "step");
  expect_invalid(StepRequest("fields", 0, 0, std::string(300, 'r')), "run_id");
  // Ranks of one step that disagree, and another run while a step is pending.
  std::future<Answer> waiting = ApplyAsync(StepRequest("fields", 0, 0, "r"), 1000);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  expect_invalid(StepRequest("fields", 1, 0, "r", 2, /*lr=*/0.2), "optimizer");
  expect_invalid(StepRequest("fields", 1, 0, "r", 3), "num_ranks");
  grpc::Status other = Apply(StepRequest("fields", 1, 0, "other-run"), &response, 5000);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(other.error_message(), HasSubstr("run_id"));
  EXPECT_EQ(waiting.get().status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST_F(DataParallelTest, DeletingTheLayerEndsAWaitingStep) {
  ASSERT_TRUE(Create("deleted", TinyConfig(6)).ok());
  std::future<Answer> waiting = ApplyAsync(StepRequest("deleted", 0, 0));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  grpc::ClientContext ctx;
  v1::DeleteLayerRequest request;
  request.set_name("deleted");
  v1::DeleteLayerResponse deleted;
  ASSERT_TRUE(stub()->DeleteLayer(&ctx, request, &deleted).ok());
  Answer answer = waiting.get();
  EXPECT_EQ(answer.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(answer.status.error_message(), HasSubstr("deleted"));
}

}  // namespace
}  // namespace moe
