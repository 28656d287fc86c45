// Admission control by estimated worker memory (issue 14; moed --worker_memory_bytes,
// server/step_memory.h): a CreateLayer, Forward or Backward whose estimated memory per worker
// does not fit beside what the workers hold is refused with RESOURCE_EXHAUSTED naming the
// limit and the flag, before any worker allocates; the cluster keeps serving, and a step just
// under the limit runs (and its real peak stays within the estimate).
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/config_convert.h"
#include "server/step_memory.h"
#include "tests/server/cluster.h"
#include "tests/server/cluster_fixture.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kHidden = 32;  // TinyConfig's
constexpr int kRanks = 2;

LayerConfig EngineConfig(const v1::LayerConfig& proto) {
  absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

class AdmissionTest : public OwnClusterTest {
 protected:
  grpc::Status Forward(const std::string& layer, int64_t tokens, bool keep,
                       v1::ForwardResponse* response) {
    grpc::ClientContext ctx;
    v1::ForwardRequest request;
    request.set_layer(layer);
    *request.mutable_x() =
        FloatsToProto({tokens, kHidden}, RandomFloats(tokens * kHidden, static_cast<int>(tokens)));
    request.set_keep_for_backward(keep);
    return cluster_->stub()->Forward(&ctx, request, response);
  }
  v1::LayerInfo Info(const std::string& layer) {
    const v1::GetStatusResponse status = Status();
    for (const v1::LayerInfo& info : status.layers()) {
      if (info.name() == layer) return info;
    }
    ADD_FAILURE() << "no layer " << layer;
    return v1::LayerInfo();
  }
  // The workers' peak memory as of a heartbeat after now (--heartbeat_ms is 500).
  std::vector<int64_t> PeakMemory() {
    absl::SleepFor(absl::Milliseconds(1200));
    std::vector<int64_t> peaks;
    const v1::GetStatusResponse status = Status();
    for (const v1::WorkerStatus& w : status.workers()) peaks.push_back(w.peak_memory_bytes());
    return peaks;
  }

};

TEST_F(AdmissionTest, OversizedStepIsRefusedBeforeAnyWorkerAllocates) {
  const v1::LayerConfig tiny = TinyConfig(1);
  const LayerConfig config = EngineConfig(tiny);
  constexpr int64_t kTokens = 512;
  const int64_t layer_bytes = LayerBytesPerWorker(config, kRanks);
  const int64_t budget = layer_bytes + ForwardStepBytes(config, kTokens, kRanks, DType::kFloat32);
  StartCluster({absl::StrCat("--worker_memory_bytes=", budget)});
  ASSERT_TRUE(Create("a", tiny).ok());
  const int64_t generation = Status().generation();
  const std::vector<int64_t> peak_before = PeakMemory();

  v1::ForwardResponse response;
  grpc::Status s = Forward("a", kTokens + 64, /*keep=*/false, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--worker_memory_bytes"));
  EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("the limit is ", budget)));
  EXPECT_THAT(s.error_message(), HasSubstr("Forward of 576 tokens on layer \"a\""));
  // No worker ran or allocated anything for it.
  EXPECT_EQ(Info("a").forward_count(), 0);
  EXPECT_EQ(PeakMemory(), peak_before);
  const v1::GetStatusResponse status = Status();
  EXPECT_TRUE(status.serving());
  EXPECT_EQ(status.generation(), generation);

  // The step at the limit runs, and what it really allocated stays within the estimate.
  s = Forward("a", kTokens, /*keep=*/false, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.out().shape(0), kTokens);
  EXPECT_EQ(Info("a").forward_count(), 1);
  for (int64_t peak : PeakMemory()) {
    EXPECT_GT(peak, 0);
    EXPECT_LE(peak, budget) << "a step allocated more than its estimate";
  }
}

TEST_F(AdmissionTest, KeptStepsCountAgainstTheLimit) {
  const v1::LayerConfig tiny = TinyConfig(2);
  const LayerConfig config = EngineConfig(tiny);
  constexpr int64_t kTokens = 512;
  const int64_t budget = LayerBytesPerWorker(config, kRanks) +
                         ForwardStepBytes(config, kTokens, kRanks, DType::kFloat32);
  StartCluster({absl::StrCat("--worker_memory_bytes=", budget)});
  ASSERT_TRUE(Create("k", tiny).ok());
  v1::ForwardResponse kept;
  ASSERT_TRUE(Forward("k", kTokens / 2, /*keep=*/true, &kept).ok());
  ASSERT_GT(Info("k").saved_bytes(), 0);
  // The kept step holds memory on the workers: the step that fitted alone does not now.
  v1::ForwardResponse response;
  grpc::Status s = Forward("k", kTokens, /*keep=*/false, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("steps kept for backward"));
  grpc::ClientContext ctx;
  v1::ReleaseStepRequest release;
  release.set_layer("k");
  release.set_step_id(kept.step_id());
  v1::ReleaseStepResponse released;
  ASSERT_TRUE(cluster_->stub()->ReleaseStep(&ctx, release, &released).ok());
  s = Forward("k", kTokens, /*keep=*/false, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// A Backward is admitted the same way, before it consumes its kept step: refused, the step is
// still there for a Backward that fits (here none does: it is released instead).
TEST_F(AdmissionTest, OversizedBackwardIsRefusedAndKeepsItsStep) {
  const v1::LayerConfig tiny = TinyConfig(7);
  const LayerConfig config = EngineConfig(tiny);
  constexpr int64_t kTokens = 512;
  const int64_t layer_bytes = LayerBytesPerWorker(config, kRanks);
  const int64_t budget = layer_bytes + ForwardStepBytes(config, kTokens, kRanks, DType::kFloat32);
  StartCluster({absl::StrCat("--worker_memory_bytes=", budget)});
  ASSERT_TRUE(Create("b", tiny).ok());
  v1::ForwardResponse kept;
  ASSERT_TRUE(Forward("b", kTokens, /*keep=*/true, &kept).ok());
  const int64_t saved = Info("b").saved_bytes();
  ASSERT_GT(
      layer_bytes + saved / kRanks + BackwardStepBytes(config, kTokens, kRanks, DType::kFloat32),
      budget)
      << "this Backward would fit: the test proves nothing";
  grpc::ClientContext ctx;
  v1::BackwardRequest request;
  request.set_layer("b");
  request.set_step_id(kept.step_id());
  *request.mutable_d_out() = FloatsToProto({kTokens, kHidden}, RandomFloats(kTokens * kHidden, 3));
  v1::BackwardResponse response;
  grpc::Status s = cluster_->stub()->Backward(&ctx, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("Backward of 512 tokens on layer \"b\""));
  EXPECT_EQ(Info("b").saved_steps(), 1);  // not consumed
  grpc::ClientContext release_ctx;
  v1::ReleaseStepRequest release;
  release.set_layer("b");
  release.set_step_id(kept.step_id());
  v1::ReleaseStepResponse released;
  ASSERT_TRUE(cluster_->stub()->ReleaseStep(&release_ctx, release, &released).ok());
  EXPECT_TRUE(released.released());
}

TEST_F(AdmissionTest, CreateLayerOverTheLimitIsRefused) {
  const v1::LayerConfig tiny = TinyConfig(3);
  const int64_t layer_bytes = LayerBytesPerWorker(EngineConfig(tiny), kRanks);
  StartCluster({absl::StrCat("--worker_memory_bytes=", layer_bytes * 3 / 2)});
  ASSERT_TRUE(Create("first", tiny).ok());
  grpc::Status s = Create("second", TinyConfig(4));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("CreateLayer of layer \"second\""));
  EXPECT_THAT(s.error_message(), HasSubstr("--worker_memory_bytes"));
  EXPECT_EQ(Status().layers_size(), 1);
  v1::ForwardResponse response;
  EXPECT_TRUE(Forward("first", 8, /*keep=*/false, &response).ok());
}

// Without the flag the limit comes from the memory the workers report (here: the host's
// physical memory shared by the two CPU workers).
TEST_F(AdmissionTest, DerivedLimitRefusesALayerLargerThanTheHost) {
  StartCluster({});
  absl::Time until = absl::Now() + absl::Seconds(10);
  int64_t capacity = 0;
  while (capacity == 0 && absl::Now() < until) {
    const v1::GetStatusResponse status = Status();
    for (const v1::WorkerStatus& w : status.workers()) capacity = w.memory_capacity_bytes();
    if (capacity == 0) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_GT(capacity, 0) << "the workers report no memory capacity";
  v1::LayerConfig huge = TinyConfig(5);  // ~206 GB per worker, under --max_layer_bytes
  huge.set_hidden(16384);
  huge.set_ffn(65536);
  ASSERT_LT(capacity, LayerBytesPerWorker(EngineConfig(huge), kRanks));
  const absl::Time start = absl::Now();
  grpc::Status s = Create("huge", huge);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("derived from the memory the workers report"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_TRUE(Create("small", TinyConfig(6)).ok());
}

}  // namespace
}  // namespace moe
