// Admission control by estimated worker memory (issue 14; moed --worker_memory_bytes,
// server/step_memory.h): a CreateLayer, Forward or Backward whose estimated memory per worker
// does not fit beside what the workers hold and what the steps running on other layers
// reserved is refused with RESOURCE_EXHAUSTED naming the limit and the flag, before any worker
// allocates; the cluster keeps serving, and a step just under the limit runs (and its real
// peak stays within the estimate).
#include <signal.h>

#include <cstdlib>
#include <optional>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/config_convert.h"
#include "server/step_memory.h"
#include "tests/server/cluster.h"
#include "tests/server/cluster_fixture.h"
#include "tests/server/metrics_scrape.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kHidden = 32;  // TinyConfig's
constexpr int kRanks = 2;
// The workers' deferral budget (their --deferred_wgrad_fraction is not given), which moed's
// estimates count.
constexpr double kFraction = kDefaultDeferredWgradFraction;

LayerConfig EngineConfig(const v1::LayerConfig& proto) {
  absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

class AdmissionTest : public OwnClusterTest {
 protected:
  // deadline: unset = none (a step admitted wrongly next to a stopped worker would wait).
  grpc::Status Forward(const std::string& layer, int64_t tokens, bool keep,
                       v1::ForwardResponse* response,
                       std::optional<absl::Duration> deadline = std::nullopt) {
    grpc::ClientContext ctx;
    if (deadline.has_value()) ctx.set_deadline(absl::ToChronoTime(absl::Now() + *deadline));
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
  // Starts the cluster with a metrics port (metrics_port_) besides `flags`.
  void StartClusterWithMetrics(std::vector<std::string> flags) {
    metrics_port_ = FreePort();
    flags.push_back(absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port_));
    StartCluster(std::move(flags));
  }
  // moed_worker_memory_reserved_bytes now.
  int64_t Reserved() {
    return static_cast<int64_t>(
        Sample(ScrapeMetrics(metrics_port_), "moed_worker_memory_reserved_bytes"));
  }
  // Waits (up to 60 s) until moed_worker_memory_reserved_bytes is `bytes`.
  bool WaitReserved(int64_t bytes) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (Reserved() != bytes) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }
  // The workers' peak memory as of a heartbeat after now (--heartbeat_ms is 500).
  std::vector<int64_t> PeakMemory() {
    absl::SleepFor(absl::Milliseconds(1200));
    std::vector<int64_t> peaks;
    const v1::GetStatusResponse status = Status();
    for (const v1::WorkerStatus& w : status.workers()) peaks.push_back(w.peak_memory_bytes());
    return peaks;
  }

  int metrics_port_ = 0;
};

TEST_F(AdmissionTest, OversizedStepIsRefusedBeforeAnyWorkerAllocates) {
  const v1::LayerConfig tiny = TinyConfig(1);
  const LayerConfig config = EngineConfig(tiny);
  constexpr int64_t kTokens = 512;
  const int64_t layer_bytes = LayerBytesPerWorker(config, kRanks, kFraction);
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
  const int64_t budget = LayerBytesPerWorker(config, kRanks, kFraction) +
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
  const int64_t layer_bytes = LayerBytesPerWorker(config, kRanks, kFraction);
  const int64_t budget = layer_bytes + ForwardStepBytes(config, kTokens, kRanks, DType::kFloat32);
  StartCluster({absl::StrCat("--worker_memory_bytes=", budget)});
  ASSERT_TRUE(Create("b", tiny).ok());
  v1::ForwardResponse kept;
  ASSERT_TRUE(Forward("b", kTokens, /*keep=*/true, &kept).ok());
  const int64_t saved = Info("b").saved_bytes();
  ASSERT_GT(
      layer_bytes + saved / kRanks +
          BackwardStepBytes(config, kTokens, kRanks, DType::kFloat32, kFraction),
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

// Steps of two layers run at the same time: with a budget that fits one large step beside the
// two layers but not two, the second is refused while the first runs (held in flight
// deterministically: worker 1 is stopped, so the first step waits for it), and admitted once
// the first ended. Checked alone, each would pass.
TEST_F(AdmissionTest, ConcurrentStepsOfDifferentLayersAreSummed) {
  const v1::LayerConfig tiny = TinyConfig(8);
  const LayerConfig config = EngineConfig(tiny);
  constexpr int64_t kTokens = 512;
  const int64_t layer_bytes = LayerBytesPerWorker(config, kRanks, kFraction);
  const int64_t step = ForwardStepBytes(config, kTokens, kRanks, DType::kFloat32);
  const int64_t budget = 2 * layer_bytes + step + step / 2;
  // A stopped worker must not be declared dead (nor its step time out) on a loaded machine.
  StartClusterWithMetrics({absl::StrCat("--worker_memory_bytes=", budget),
                           "--worker_dead_after_ms=120000", "--step_timeout_ms=120000"});
  ASSERT_TRUE(Create("a", tiny).ok());
  ASSERT_TRUE(Create("b", TinyConfig(9)).ok());
  ASSERT_EQ(Reserved(), 0);

  ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));
  grpc::Status first;
  std::thread running([&] {
    v1::ForwardResponse response;
    first = Forward("a", kTokens, /*keep=*/false, &response);
  });
  // Admitted: its estimate is reserved while it waits for worker 1.
  const bool in_flight = WaitReserved(step);
  grpc::Status second;
  if (in_flight) {
    v1::ForwardResponse response;  // admitted wrongly, it would wait for worker 1
    second = Forward("b", kTokens, /*keep=*/false, &response, absl::Seconds(20));
  }
  EXPECT_TRUE(cluster_->KillWorker(1, SIGCONT));  // before any return: threads to join
  running.join();
  ASSERT_TRUE(in_flight) << "the first step's reservation never showed: " << Reserved();
  EXPECT_TRUE(first.ok()) << first.error_message();
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << second.error_message();
  EXPECT_THAT(second.error_message(), HasSubstr("Forward of 512 tokens on layer \"b\""));
  EXPECT_THAT(second.error_message(), HasSubstr(absl::StrCat("reserve ", step, " more")));
  EXPECT_THAT(second.error_message(), HasSubstr("--worker_memory_bytes"));
  EXPECT_EQ(Info("b").forward_count(), 0);

  // One after the other, both fit; and nothing stays reserved.
  EXPECT_TRUE(WaitReserved(0)) << Reserved();
  v1::ForwardResponse response;
  grpc::Status s = Forward("b", kTokens, /*keep=*/false, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = Forward("a", kTokens, /*keep=*/false, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Info("a").forward_count(), 2);
  EXPECT_EQ(Info("b").forward_count(), 1);
  EXPECT_EQ(Reserved(), 0);
}

// DeleteLayer takes the layer off the books at once, but the workers free it only after its
// running step: it stays reserved until they dropped it, so a step of another layer that fits
// only without it is refused meanwhile.
TEST_F(AdmissionTest, LayerBeingDeletedCountsUntilTheWorkersDroppedIt) {
  const v1::LayerConfig tiny = TinyConfig(12);
  const LayerConfig config = EngineConfig(tiny);
  constexpr int64_t kTokens = 512, kSmall = 8;
  const int64_t layer_bytes = LayerBytesPerWorker(config, kRanks, kFraction);
  const int64_t step = ForwardStepBytes(config, kTokens, kRanks, DType::kFloat32);
  const int64_t small = ForwardStepBytes(config, kSmall, kRanks, DType::kFloat32);
  ASSERT_GE(layer_bytes, small) << "the small step would not fit anyway: the test proves nothing";
  const int64_t budget = 2 * layer_bytes + step;
  StartClusterWithMetrics({absl::StrCat("--worker_memory_bytes=", budget),
                           "--worker_dead_after_ms=120000", "--step_timeout_ms=120000"});
  ASSERT_TRUE(Create("a", tiny).ok());
  ASSERT_TRUE(Create("b", TinyConfig(13)).ok());

  ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));
  grpc::Status first, deleted;
  std::thread running([&] {
    v1::ForwardResponse response;
    first = Forward("a", kTokens, /*keep=*/false, &response);
  });
  const bool in_flight = WaitReserved(step);
  std::thread deleting;
  if (in_flight) {
    deleting = std::thread([&] {
      grpc::ClientContext ctx;
      v1::DeleteLayerRequest request;
      request.set_name("a");
      v1::DeleteLayerResponse response;
      deleted = cluster_->stub()->DeleteLayer(&ctx, request, &response);
    });
  }
  // Off the books (no longer listed), waiting for the step's turn: its shard is reserved.
  bool leaving = false;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (in_flight && !leaving && absl::Now() < give_up) {
    const v1::GetStatusResponse status = Status();
    leaving = true;
    for (const v1::LayerInfo& info : status.layers()) leaving = leaving && info.name() != "a";
    if (!leaving) absl::SleepFor(absl::Milliseconds(20));
  }
  const int64_t reserved_while_leaving = Reserved();
  grpc::Status second;
  if (leaving) {
    v1::ForwardResponse response;  // admitted wrongly, it would wait for worker 1
    second = Forward("b", kSmall, /*keep=*/false, &response, absl::Seconds(20));
  }
  EXPECT_TRUE(cluster_->KillWorker(1, SIGCONT));  // before any return: threads to join
  running.join();
  if (deleting.joinable()) deleting.join();
  ASSERT_TRUE(in_flight) << "the step's reservation never showed: " << Reserved();
  ASSERT_TRUE(leaving) << "DeleteLayer never took the layer off the books";
  EXPECT_EQ(reserved_while_leaving, step + layer_bytes);
  EXPECT_TRUE(first.ok()) << first.error_message();
  EXPECT_TRUE(deleted.ok()) << deleted.error_message();
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << second.error_message();

  // The workers dropped it: nothing reserved, and the small step (the large one too) fits.
  EXPECT_TRUE(WaitReserved(0)) << Reserved();
  v1::ForwardResponse response;
  grpc::Status s = Forward("b", kSmall, /*keep=*/false, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = Forward("b", kTokens, /*keep=*/false, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(AdmissionTest, CreateLayerOverTheLimitIsRefused) {
  const v1::LayerConfig tiny = TinyConfig(3);
  const int64_t layer_bytes = LayerBytesPerWorker(EngineConfig(tiny), kRanks, kFraction);
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
  ASSERT_LT(capacity, LayerBytesPerWorker(EngineConfig(huge), kRanks, kFraction));
  const absl::Time start = absl::Now();
  grpc::Status s = Create("huge", huge);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("derived from the memory the workers report"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_TRUE(Create("small", TinyConfig(6)).ok());
}

// moed counts the deferral budget the workers report (PingResponse.deferred_wgrad_fraction)
// as memory every layer may hold: with workers that keep half their weight gradients' bytes, a
// step that fits beside the default budget's layer is refused, and GetStatus shows the
// workers' fraction.
TEST_F(AdmissionTest, TheWorkersDeferralBudgetCountsAgainstTheLimit) {
  const v1::LayerConfig tiny = TinyConfig(14);
  const LayerConfig config = EngineConfig(tiny);
  constexpr int64_t kTokens = 512;
  constexpr double kWorkers = 0.5;
  const int64_t step = ForwardStepBytes(config, kTokens, kRanks, DType::kFloat32);
  const int64_t budget = LayerBytesPerWorker(config, kRanks, kFraction) + step;
  ASSERT_GT(LayerBytesPerWorker(config, kRanks, kWorkers) + step, budget);
  // Embedded workers: moed passes the engine flag on to the workers it starts
  // (server/engine_flags.h).
  ClusterOptions options;
  options.embedded = true;
  options.workers = kRanks;
  options.moed_flags = {absl::StrCat("--worker_memory_bytes=", budget),
                        "--deferred_wgrad_fraction=0.5"};
  StartClusterWith(options);
  bool reported = false;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!reported && absl::Now() < until) {
    const v1::GetStatusResponse status = Status();
    reported = status.workers_size() == kRanks;
    for (const v1::WorkerStatus& w : status.workers()) {
      reported = reported && w.has_deferred_wgrad_fraction();
      if (w.has_deferred_wgrad_fraction()) {
        EXPECT_EQ(w.deferred_wgrad_fraction(), kWorkers);
      }
    }
    if (!reported) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(reported) << "the workers report no deferral fraction";
  ASSERT_TRUE(Create("d", tiny).ok());
  v1::ForwardResponse response;
  grpc::Status s = Forward("d", kTokens, /*keep=*/false, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(),
              HasSubstr(absl::StrCat("hold ", LayerBytesPerWorker(config, kRanks, kWorkers))));
  EXPECT_EQ(Info("d").forward_count(), 0);
  EXPECT_TRUE(Forward("d", kTokens / 4, /*keep=*/false, &response).ok());
}

}  // namespace
}  // namespace moe
