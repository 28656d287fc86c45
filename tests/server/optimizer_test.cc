// moed + 2 real moe-worker processes: what an optimizer step keeps and restores. A step on
// gradients holding a NaN or an Inf is refused (FAILED_PRECONDITION naming the tensor) or,
// with skip_non_finite, skipped and counted, and leaves the weights, the AdamW moments and
// optimizer_step as they were; LoadCheckpoint restores the optimizer_step and the moments of
// the step the checkpoint was saved at. "As they were" is checked bit for bit: the layer's
// next finite step must equal that of a twin layer that never saw the bad step.
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster_fixture.h"
#include "tests/server/metrics_scrape.h"

namespace moe {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

using Tensors = std::map<std::string, std::vector<float>>;

// Same names, same bytes (NaN included; -0 differs from +0).
bool BitIdentical(const Tensors& a, const Tensors& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, values] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.size() != values.size() ||
        std::memcmp(values.data(), it->second.data(), values.size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

bool AllFinite(const Tensors& tensors) {
  for (const auto& [name, values] : tensors) {
    for (float v : values) {
      if (!std::isfinite(v)) return false;
    }
  }
  return true;
}

class OptimizerTest : public ClusterTest {
 protected:
  // Forward + Backward of batch `seed` (6 tokens); with `poison`, one element of d_out is NaN.
  void ForwardBackward(const std::string& layer, uint32_t seed, bool poison = false) {
    v1::ForwardResponse fwd;
    ASSERT_TRUE(
        Forward(layer, FloatsToProto({6, 32}, RandomFloats(6 * 32, seed)), true, &fwd).ok());
    std::vector<float> d_out = RandomFloats(6 * 32, seed + 1000);
    if (poison) d_out[37] = std::numeric_limits<float>::quiet_NaN();
    v1::BackwardResponse bwd;
    grpc::Status s = Backward(layer, fwd.step_id(), FloatsToProto({6, 32}, d_out), &bwd);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  grpc::Status Step(const std::string& layer, v1::ApplyOptimizerResponse* response,
                    bool skip_non_finite = false) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ApplyOptimizerRequest request;
    request.set_layer(layer);
    request.mutable_adamw()->set_lr(1e-2);
    request.mutable_adamw()->set_weight_decay(0.01);
    request.set_skip_non_finite(skip_non_finite);
    return stub()->ApplyOptimizer(&ctx, request, response);
  }
  // A whole training step with batch `seed`; fatal unless it steps.
  void TrainStep(const std::string& layer, uint32_t seed) {
    ForwardBackward(layer, seed);
    v1::ApplyOptimizerResponse response;
    grpc::Status s = Step(layer, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_FALSE(response.skipped_non_finite());
  }
  int64_t OptimizerStep(const std::string& layer) {
    grpc::ClientContext ctx;
    v1::GetLayerRequest request;
    request.set_name(layer);
    v1::GetLayerResponse response;
    EXPECT_TRUE(stub()->GetLayer(&ctx, request, &response).ok());
    return response.layer().optimizer_step();
  }
  grpc::Status Checkpoint(bool save, const std::string& layer, const std::string& name,
                          v1::LoadCheckpointResponse* loaded = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (save) {
      v1::SaveCheckpointRequest request;
      request.set_layer(layer);
      request.set_directory(name);
      v1::SaveCheckpointResponse response;
      return stub()->SaveCheckpoint(&ctx, request, &response);
    }
    v1::LoadCheckpointRequest request;
    request.set_layer(layer);
    request.set_directory(name);
    v1::LoadCheckpointResponse response;
    grpc::Status s = stub()->LoadCheckpoint(&ctx, request, &response);
    if (loaded != nullptr) *loaded = response;
    return s;
  }
};

TEST_F(OptimizerTest, NonFiniteGradientsAreRefusedAndChangeNothing) {
  ASSERT_TRUE(Create("refused", TinyConfig(11)).ok());
  ASSERT_TRUE(Create("refused_twin", TinyConfig(11)).ok());
  TrainStep("refused", 1);  // AdamW moments and step count exist from here on
  TrainStep("refused_twin", 1);
  const Tensors before = Weights("refused", false);
  ASSERT_TRUE(BitIdentical(before, Weights("refused_twin", false)));

  ForwardBackward("refused", 2, /*poison=*/true);
  ASSERT_FALSE(AllFinite(Weights("refused", true)));
  v1::ApplyOptimizerResponse response;
  grpc::Status s = Step("refused", &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), MatchesRegex(".*gradient of [a-z_]+ has non-finite values.*"));
  EXPECT_THAT(s.error_message(), HasSubstr("skip_non_finite"));
  EXPECT_TRUE(BitIdentical(Weights("refused", false), before));
  EXPECT_EQ(OptimizerStep("refused"), 1);
  EXPECT_FALSE(AllFinite(Weights("refused", true)));  // kept, for the trainer to look at

  // The next finite step equals the twin's: moments and the AdamW step count are untouched.
  grpc::ClientContext ctx;
  v1::ZeroGradientsRequest zero;
  zero.set_layer("refused");
  v1::ZeroGradientsResponse zeroed;
  ASSERT_TRUE(stub()->ZeroGradients(&ctx, zero, &zeroed).ok());
  TrainStep("refused", 3);
  TrainStep("refused_twin", 3);
  EXPECT_EQ(OptimizerStep("refused"), 2);
  const Tensors after = Weights("refused", false);
  EXPECT_TRUE(AllFinite(after));
  EXPECT_FALSE(BitIdentical(after, before));
  EXPECT_TRUE(BitIdentical(after, Weights("refused_twin", false)));
}

TEST_F(OptimizerTest, SkipNonFiniteSkipsTheStepZeroesTheGradientsAndCountsIt) {
  ASSERT_TRUE(Create("skipped", TinyConfig(12)).ok());
  ASSERT_TRUE(Create("skipped_twin", TinyConfig(12)).ok());
  TrainStep("skipped", 1);
  TrainStep("skipped_twin", 1);
  const Tensors before = Weights("skipped", false);
  const std::string series = "moed_optimizer_steps_skipped_total{layer=\"skipped\"}";
  EXPECT_EQ(Sample(ScrapeMetrics(metrics_port_), series), 0);

  ForwardBackward("skipped", 2, /*poison=*/true);
  v1::ApplyOptimizerResponse response;
  grpc::Status s = Step("skipped", &response, /*skip_non_finite=*/true);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(response.skipped_non_finite());
  EXPECT_FALSE(response.non_finite_tensor().empty());
  EXPECT_EQ(response.optimizer_step(), 1);
  EXPECT_EQ(OptimizerStep("skipped"), 1);
  EXPECT_TRUE(BitIdentical(Weights("skipped", false), before));
  for (const auto& [name, values] : Weights("skipped", true)) {
    for (float v : values) ASSERT_EQ(v, 0.0f) << name;  // zeroed, as AMP's scaler does
  }
  EXPECT_EQ(Sample(ScrapeMetrics(metrics_port_), series), 1);

  // A finite step with the option set is an ordinary step, equal to the twin's.
  ForwardBackward("skipped", 3);
  ASSERT_TRUE(Step("skipped", &response, /*skip_non_finite=*/true).ok());
  EXPECT_FALSE(response.skipped_non_finite());
  EXPECT_EQ(response.optimizer_step(), 2);
  TrainStep("skipped_twin", 3);
  EXPECT_TRUE(BitIdentical(Weights("skipped", false), Weights("skipped_twin", false)));
  EXPECT_EQ(Sample(ScrapeMetrics(metrics_port_), series), 1);
}

TEST_F(OptimizerTest, LoadCheckpointRestoresTheStepAndTheMomentsItWasSavedAt) {
  ASSERT_TRUE(Create("resumed", TinyConfig(13)).ok());
  TrainStep("resumed", 1);
  TrainStep("resumed", 2);
  ASSERT_TRUE(Checkpoint(/*save=*/true, "resumed", "optimizer/k2").ok());
  TrainStep("resumed", 3);
  const Tensors first_step3 = Weights("resumed", false);
  TrainStep("resumed", 4);
  TrainStep("resumed", 5);
  ASSERT_EQ(OptimizerStep("resumed"), 5);

  v1::LoadCheckpointResponse loaded;
  grpc::Status s = Checkpoint(/*save=*/false, "resumed", "optimizer/k2", &loaded);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(loaded.optimizer_step(), 2);
  EXPECT_EQ(OptimizerStep("resumed"), 2);
  // Step 3 again: bit for bit what it gave the first time (AdamW m, v and step count restored).
  ForwardBackward("resumed", 3);
  v1::ApplyOptimizerResponse response;
  ASSERT_TRUE(Step("resumed", &response).ok());
  EXPECT_EQ(response.optimizer_step(), 3);
  EXPECT_TRUE(BitIdentical(Weights("resumed", false), first_step3));
}

}  // namespace
}  // namespace moe
