// A diverged layer that is not durable (no --state_dir; issue 14). Worker 1 is stopped while
// two layers take an optimizer step: worker 0 applied it, worker 1 did not, so both layers are
// diverged, and they stay so after the same worker comes back (nothing durable to reload):
// every call that would use the mixed state is FAILED_PRECONDITION naming the ways out. A
// SetWeights of every parameter repairs one (its optimizer state starts again from zero on
// every worker: a step afterwards equals a fresh layer's with those weights, bit for bit); a
// SetWeights of some parameters does not; a LoadCheckpoint repairs the other (the checkpoint's
// weights, bit for bit).
#include <signal.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "client/moe_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using client::MoeClient;
using ::testing::HasSubstr;

class DivergedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = TestCluster::Start(ClusterOptions());
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
    auto client = MoeClient::Connect(cluster_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  static v1::SgdOptimizer Sgd() {
    v1::SgdOptimizer sgd;
    sgd.set_lr(0.05);
    sgd.set_momentum(0.9);  // optimizer state that can differ between the workers
    return sgd;
  }
  // Forward (kept) and Backward of data `seed`.
  absl::Status ForwardBackward(const std::string& layer, uint32_t seed) {
    const int64_t tokens = 24;
    Tensor x = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, seed));
    auto forward = client_->Forward(layer, x, /*keep_for_backward=*/true);
    if (!forward.ok()) return forward.status();
    Tensor d_out = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, seed + 1000));
    return client_->Backward(layer, forward->step_id, d_out).status();
  }
  absl::Status Train(const std::string& layer, uint32_t seed) {
    absl::Status s = ForwardBackward(layer, seed);
    return s.ok() ? client_->ApplySgd(layer, Sgd()) : s;
  }
  std::vector<NamedTensor> Weights(const std::string& layer) {
    auto weights = client_->GetWeights(layer);
    EXPECT_TRUE(weights.ok()) << weights.status();
    return weights.ok() ? *weights : std::vector<NamedTensor>();
  }
  static std::map<std::string, std::string> Bytes(const std::vector<NamedTensor>& tensors) {
    std::map<std::string, std::string> out;
    for (const NamedTensor& t : tensors) out[t.name] = std::string(t.tensor.bytes());
    return out;
  }
  std::string Diverged(const std::string& layer) {
    auto info = client_->GetLayer(layer);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->diverged() : "?";
  }
  bool WaitNewGeneration(int64_t generation) {
    return cluster_->WaitNewGeneration(generation, absl::Seconds(30)).ok();
  }

  std::unique_ptr<TestCluster> cluster_;
  std::unique_ptr<MoeClient> client_;
};

TEST_F(DivergedTest, SetWeightsOrLoadCheckpointRepairsALayerThatIsNotDurable) {
  v1::LayerConfig config = TinyConfig(21);
  config.set_score_function(v1::SCORE_FUNCTION_SIGMOID);
  config.set_use_expert_bias(true);
  for (const char* layer : {"s", "l", "twin"}) {
    ASSERT_TRUE(client_->CreateLayer(layer, config).ok());
  }
  for (const char* layer : {"s", "l"}) ASSERT_TRUE(Train(layer, 1).ok());
  const std::vector<NamedTensor> good_s = Weights("s");
  ASSERT_TRUE(client_->SaveCheckpoint("l", "l_good").ok());
  const std::vector<NamedTensor> good_l = Weights("l");
  for (const char* layer : {"s", "l"}) ASSERT_TRUE(ForwardBackward(layer, 2).ok());
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok());

  // Both updates reach worker 0; worker 1 is stopped until it counts as dead. (Expert-bias
  // updates: a stopped worker fails an ApplyOptimizer's read-only gradient check before any
  // worker steps, so that no longer diverges a layer.)
  ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));
  absl::Status applied[2];
  std::thread other([&] { applied[1] = client_->UpdateExpertBias("l", 0.01).status(); });
  applied[0] = client_->UpdateExpertBias("s", 0.01).status();
  other.join();
  EXPECT_FALSE(applied[0].ok());
  EXPECT_FALSE(applied[1].ok());
  ASSERT_TRUE(cluster_->KillWorker(1, SIGCONT));  // the same process rejoins
  ASSERT_TRUE(WaitNewGeneration(status->generation()));
  for (const char* layer : {"s", "l"}) {
    EXPECT_THAT(Diverged(layer), HasSubstr("UpdateExpertBias")) << layer;
  }

  // Refused while diverged, naming the ways out.
  const Tensor x = Tensor::FromFloats({8, 32}, RandomFloats(8 * 32, 3));
  auto refused = client_->Forward("s", x);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("LoadCheckpoint"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("SetWeights of every parameter"));

  // Some parameters: those agree now, the rest may not: still diverged.
  std::vector<NamedTensor> gate_only;
  for (const NamedTensor& t : good_s) {
    if (t.name == "gate") gate_only.push_back(t);
  }
  ASSERT_TRUE(client_->SetWeights("s", gate_only).ok());
  EXPECT_THAT(Diverged("s"), HasSubstr("UpdateExpertBias"));

  // Every parameter: repaired, the weights are the ones set.
  ASSERT_TRUE(client_->SetWeights("s", good_s).ok());
  EXPECT_EQ(Diverged("s"), "");
  EXPECT_EQ(Bytes(Weights("s")), Bytes(good_s));
  // The optimizer state was reset on every worker: a step now equals a fresh layer's.
  ASSERT_TRUE(client_->SetWeights("twin", good_s).ok());
  for (const char* layer : {"s", "twin"}) {
    absl::Status trained = Train(layer, 4);
    ASSERT_TRUE(trained.ok()) << layer << ": " << trained;
  }
  EXPECT_EQ(Bytes(Weights("s")), Bytes(Weights("twin")));

  // LoadCheckpoint repairs the other.
  ASSERT_TRUE(client_->LoadCheckpoint("l", "l_good").ok());
  EXPECT_EQ(Diverged("l"), "");
  EXPECT_EQ(Bytes(Weights("l")), Bytes(good_l));
  EXPECT_TRUE(client_->Forward("l", x).ok());
}

}  // namespace
}  // namespace moe
