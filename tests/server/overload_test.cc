// Issue 41, item 10: overload. 64 callers at once send steps that keep their activations for
// a backward to 4 layers of 2 CPU workers whose --worker_memory_bytes holds the layers and
// only a few steps: the steps that do not fit are refused with RESOURCE_EXHAUSTED by
// admission control (server/moe_service_admission.cc) before any worker allocates, every other
// step succeeds, nothing else fails (no UNAVAILABLE: the busy workers are not declared dead,
// the pool does not re-form), the workers' memory stays within the budget, and once the
// callers released their steps the service serves again.
//
// Scaled for a loaded 2-core machine: the admission flag is tuned down to the test's small
// layers instead of sending huge tensors. It pins today's behaviour (it passes on the main it
// was written against). At full scale (64 callers of 4000-token steps, H 256) on a 2-core
// machine at load ~80 the workers missed pings for over --worker_dead_after_ms and the pool
// re-formed (UNAVAILABLE): liveness timeouts, not admission control, are what gives there.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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

constexpr int kRanks = 2;
constexpr int kLayers = 4;
constexpr int kCallers = 64;
constexpr int64_t kTokens = 1024;
constexpr int64_t kHidden = 64;

v1::LayerConfig OverloadConfig(int layer) {
  v1::LayerConfig c;
  c.set_hidden(kHidden);
  c.set_ffn(128);
  c.set_num_experts(4);
  c.set_top_k(2);
  c.set_init_seed(100 + layer);
  return c;
}

class OverloadTest : public OwnClusterTest {
 protected:
  grpc::Status Forward(int layer, bool keep, uint64_t* step_id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    v1::ForwardRequest request;
    request.set_layer(absl::StrCat("L", layer));
    *request.mutable_x() =
        FloatsToProto({kTokens, kHidden}, RandomFloats(kTokens * kHidden, layer + 1));
    request.set_keep_for_backward(keep);
    v1::ForwardResponse response;
    grpc::Status s = cluster_->stub()->Forward(&ctx, request, &response);
    *step_id = response.step_id();
    return s;
  }
  void Release(int layer, uint64_t step_id) {
    grpc::ClientContext ctx;
    v1::ReleaseStepRequest request;
    request.set_layer(absl::StrCat("L", layer));
    request.set_step_id(step_id);
    v1::ReleaseStepResponse response;
    grpc::Status s = cluster_->stub()->ReleaseStep(&ctx, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
};

TEST_F(OverloadTest, RefusedByAdmissionControlThenServesAgain) {
  absl::StatusOr<LayerConfig> config = ConfigFromProto(OverloadConfig(0));
  ASSERT_TRUE(config.ok()) << config.status();
  // The layers, and room for about three steps of one (what a kept step holds is less than a
  // running step's worst case, so several kept steps fit too before refusals start).
  const int64_t layers =
      kLayers * LayerBytesPerWorker(*config, kRanks, kDefaultDeferredWgradFraction);
  const int64_t step = ForwardStepBytes(*config, kTokens, kRanks, DType::kFloat32);
  const int64_t budget = layers + 3 * step;
  StartCluster({absl::StrCat("--worker_memory_bytes=", budget), "--max_saved_steps=64"});
  for (int l = 0; l < kLayers; ++l)
    ASSERT_TRUE(Create(absl::StrCat("L", l), OverloadConfig(l)).ok());
  const int64_t generation = Status().generation();
  const pid_t workers[kRanks] = {cluster_->worker_pid(0), cluster_->worker_pid(1)};
  int64_t baseline[kRanks];
  for (int r = 0; r < kRanks; ++r) baseline[r] = ResidentBytes(workers[r]);

  std::atomic<bool> storm{true};
  int64_t peak[kRanks] = {0, 0};
  std::thread sampler([&] {
    while (storm.load()) {
      for (int r = 0; r < kRanks; ++r) peak[r] = std::max(peak[r], ResidentBytes(workers[r]));
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  std::mutex mu;
  std::map<grpc::StatusCode, int> codes;
  std::vector<std::string> unexpected;
  std::vector<std::pair<int, uint64_t>> kept;
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      uint64_t step_id = 0;
      const grpc::Status s = Forward(c % kLayers, /*keep=*/true, &step_id);
      std::lock_guard<std::mutex> lock(mu);
      ++codes[s.error_code()];
      if (s.ok()) {
        kept.emplace_back(c % kLayers, step_id);
      } else if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED ||
                 s.error_message().find("--worker_memory_bytes") == std::string::npos) {
        unexpected.push_back(absl::StrCat(s.error_code(), ": ", s.error_message()));
      }
    });
  }
  for (std::thread& t : callers) t.join();
  storm = false;
  sampler.join();

  EXPECT_THAT(unexpected, ::testing::IsEmpty());
  EXPECT_GT(codes[grpc::StatusCode::RESOURCE_EXHAUSTED], 0) << "nothing was refused";
  EXPECT_GT(codes[grpc::StatusCode::OK], 0) << "nothing was admitted";
  EXPECT_EQ(Status().generation(), generation) << "the pool re-formed under load";
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(kill(workers[r], 0), 0) << "worker " << r << " died";
    // The budget bounds what the engine allocates per worker; allocator slack besides.
    EXPECT_LE(peak[r] - baseline[r], budget + (int64_t{64} << 20))
        << "worker " << r << " grew from " << baseline[r] << " to " << peak[r] << " bytes";
  }

  // Recovery: the callers release what they kept, and every layer serves again.
  for (const auto& [layer, step_id] : kept) Release(layer, step_id);
  for (int l = 0; l < kLayers; ++l) {
    uint64_t step_id = 0;
    const grpc::Status s = Forward(l, /*keep=*/false, &step_id);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(*cluster_->Health(), "SERVING");
}

}  // namespace
}  // namespace moe
