// Worker faults: SIGKILL between and during steps, SIGSTOP (a worker that stops answering).
// Clients get UNAVAILABLE within the bound and never hang, moed stays up with health
// NOT_SERVING and GetStatus naming the worker; a restarted worker rejoins, layers are
// re-created, a checkpoint restores the weights and service resumes.
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/cluster_fixture.h"
#include "tests/server/metrics_scrape.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

// The cluster runs with --worker_dead_after_ms=1500 and --collective_timeout_ms=5000.
constexpr absl::Duration kFailureBound = absl::Seconds(5);

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = TestCluster::Start(ClusterOptions{});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  grpc::Status Create(const std::string& name, bool expert_bias = false) {
    grpc::ClientContext ctx;
    v1::CreateLayerRequest request;
    request.set_name(name);
    *request.mutable_config() = TinyConfig(11);
    if (expert_bias) {  // needs sigmoid scores
      request.mutable_config()->set_score_function(v1::SCORE_FUNCTION_SIGMOID);
      request.mutable_config()->set_use_expert_bias(true);
    }
    v1::CreateLayerResponse response;
    return cluster_->stub()->CreateLayer(&ctx, request, &response);
  }
  grpc::Status Forward(const std::string& layer, int64_t tokens, bool keep,
                       v1::ForwardResponse* response, absl::Duration deadline = absl::Seconds(30)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::ForwardRequest request;
    request.set_layer(layer);
    *request.mutable_x() = FloatsToProto({tokens, 32}, RandomFloats(tokens * 32, tokens));
    request.set_keep_for_backward(keep);
    return cluster_->stub()->Forward(&ctx, request, response);
  }
  v1::GetStatusResponse Status() {
    grpc::ClientContext ctx;
    v1::GetStatusResponse status;
    EXPECT_TRUE(cluster_->stub()->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
    return status;
  }
  std::vector<float> Wi(const std::string& layer) {
    grpc::ClientContext ctx;
    v1::GetWeightsRequest request;
    request.set_layer(layer);
    request.add_names("wi");
    auto reader = cluster_->stub()->GetWeights(&ctx, request);
    grpc::Status status;
    auto weights = ReadChunks(reader.get(), &status);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return weights["wi"];
  }
  grpc::Status Checkpoint(const std::string& layer, const std::string& dir, bool save) {
    grpc::ClientContext ctx;
    if (save) {
      v1::SaveCheckpointRequest request;
      request.set_layer(layer);
      request.set_directory(dir);
      v1::SaveCheckpointResponse response;
      return cluster_->stub()->SaveCheckpoint(&ctx, request, &response);
    }
    v1::LoadCheckpointRequest request;
    request.set_layer(layer);
    request.set_directory(dir);
    v1::LoadCheckpointResponse response;
    return cluster_->stub()->LoadCheckpoint(&ctx, request, &response);
  }
  bool WeightsReset(const std::string& layer) {
    grpc::ClientContext ctx;
    v1::GetLayerRequest request;
    request.set_name(layer);
    v1::GetLayerResponse response;
    EXPECT_TRUE(cluster_->stub()->GetLayer(&ctx, request, &response).ok());
    return response.layer().weights_reset();
  }
  void ExpectNotServingSoon() {
    const absl::Time give_up = absl::Now() + kFailureBound;
    absl::StatusOr<std::string> health = cluster_->Health();
    while (absl::Now() < give_up && (!health.ok() || *health != "NOT_SERVING")) {
      absl::SleepFor(absl::Milliseconds(20));
      health = cluster_->Health();
    }
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, "NOT_SERVING");
  }

  std::unique_ptr<TestCluster> cluster_;
};

TEST_F(FaultTest, KillBetweenStepsThenRejoinAndLoad) {
  ASSERT_TRUE(Create("f").ok());
  // Train one step so the weights differ from the seed's, then checkpoint them.
  v1::ForwardResponse fwd;
  ASSERT_TRUE(Forward("f", 16, true, &fwd).ok());
  {
    grpc::ClientContext ctx;
    v1::BackwardRequest request;
    request.set_layer("f");
    request.set_step_id(fwd.step_id());
    *request.mutable_d_out() = FloatsToProto({16, 32}, RandomFloats(16 * 32, 5));
    v1::BackwardResponse response;
    ASSERT_TRUE(cluster_->stub()->Backward(&ctx, request, &response).ok());
    grpc::ClientContext ctx2;
    v1::ApplyOptimizerRequest opt;
    opt.set_layer("f");
    opt.mutable_sgd()->set_lr(0.5);
    v1::ApplyOptimizerResponse done;
    ASSERT_TRUE(cluster_->stub()->ApplyOptimizer(&ctx2, opt, &done).ok());
  }
  const std::vector<float> trained = Wi("f");
  const std::string dir = "ckpt_fault";
  ASSERT_TRUE(Checkpoint("f", dir, /*save=*/true).ok());
  ASSERT_TRUE(Forward("f", 8, true, &fwd).ok());
  const uint64_t old_step = fwd.step_id();
  ASSERT_TRUE(Forward("f", 8, true, &fwd).ok());
  const uint64_t released_step = fwd.step_id();

  cluster_->KillWorker(1, SIGKILL);
  absl::Time start = absl::Now();
  grpc::Status s = Forward("f", 8, false, &fwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(absl::Now() - start, kFailureBound);
  ExpectNotServingSoon();
  start = absl::Now();
  s = Forward("f", 8, false, &fwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_TRUE(cluster_->MoedRunning());
  v1::GetStatusResponse status = Status();
  EXPECT_FALSE(status.serving());
  ASSERT_EQ(status.workers_size(), 2);
  EXPECT_TRUE(status.workers(0).alive());
  EXPECT_FALSE(status.workers(1).alive());
  EXPECT_FALSE(status.workers(1).error().empty());
  EXPECT_THAT(status.message(), HasSubstr("worker 1"));
  {  // ReleaseStep works while the workers are down.
    grpc::ClientContext ctx;
    v1::ReleaseStepRequest request;
    request.set_layer("f");
    request.set_step_id(released_step);
    v1::ReleaseStepResponse response;
    ASSERT_TRUE(cluster_->stub()->ReleaseStep(&ctx, request, &response).ok());
    EXPECT_TRUE(response.released());
  }

  ASSERT_TRUE(cluster_->RestartWorker(1).ok());
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
  EXPECT_GT(Status().generation(), status.generation());
  // The layer is back (re-created from its config), its old steps are gone.
  {
    grpc::ClientContext ctx;
    v1::BackwardRequest request;
    request.set_layer("f");
    request.set_step_id(old_step);
    *request.mutable_d_out() = FloatsToProto({8, 32}, RandomFloats(8 * 32, 6));
    v1::BackwardResponse response;
    EXPECT_EQ(cluster_->stub()->Backward(&ctx, request, &response).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  EXPECT_NE(Wi("f"), trained);  // fresh from the seed until the checkpoint is loaded
  EXPECT_TRUE(WeightsReset("f"));
  ASSERT_TRUE(Checkpoint("f", dir, /*save=*/false).ok());
  EXPECT_EQ(Wi("f"), trained);
  EXPECT_FALSE(WeightsReset("f"));
  EXPECT_TRUE(Forward("f", 8, true, &fwd).ok());
}

// issue 18: a worker lost is counted (moed_worker_deaths_total) and the gauges follow it.
TEST(FaultMetricsTest, WorkerDeathIsCounted) {
  ClusterOptions options;
  const int port = FreePort();
  options.moed_flags = {absl::StrCat("--metrics_listen=127.0.0.1:", port)};
  auto started = TestCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<TestCluster> cluster = std::move(*started);
  ASSERT_TRUE(cluster->WaitServing(absl::Seconds(30)).ok());
  std::string scrape = ScrapeMetrics(port);
  ASSERT_THAT(scrape, ::testing::HasSubstr("200 OK"));
  EXPECT_EQ(Sample(scrape, "moed_worker_deaths_total"), 0);
  EXPECT_EQ(Sample(scrape, "moed_worker_alive{rank=\"1\"}"), 1);
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL));
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  do {
    absl::SleepFor(absl::Milliseconds(100));
    scrape = ScrapeMetrics(port);
  } while (Sample(scrape, "moed_worker_deaths_total") < 1 && absl::Now() < deadline);
  EXPECT_EQ(Sample(scrape, "moed_worker_deaths_total"), 1);
}

TEST_F(FaultTest, KillDuringStepsNeverHangs) {
  ASSERT_TRUE(Create("a").ok());
  ASSERT_TRUE(Create("b").ok());
  std::atomic<bool> stop{false};
  std::atomic<int> unavailable{0}, ok{0};
  std::atomic<int64_t> slowest_ms{0};
  auto client = [&](const std::string& layer) {
    while (!stop) {
      const absl::Time start = absl::Now();
      v1::ForwardResponse fwd;
      grpc::Status s = Forward(layer, 512, false, &fwd, absl::Seconds(60));
      const int64_t ms = absl::ToInt64Milliseconds(absl::Now() - start);
      if (ms > slowest_ms) slowest_ms = ms;
      if (s.ok()) ++ok;
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE) ++unavailable;
      if (!s.ok()) absl::SleepFor(absl::Milliseconds(20));
    }
  };
  std::thread t1(client, "a"), t2(client, "b");
  absl::SleepFor(absl::Milliseconds(500));
  const int ok_before_kill = ok;
  cluster_->KillWorker(0, SIGKILL);
  absl::SleepFor(absl::Seconds(2));
  stop = true;
  t1.join();
  t2.join();
  EXPECT_GT(ok_before_kill, 0);
  EXPECT_GT(unavailable, 0);
  EXPECT_LT(slowest_ms, absl::ToInt64Milliseconds(kFailureBound));
  EXPECT_TRUE(cluster_->MoedRunning());
  ASSERT_TRUE(cluster_->RestartWorker(0).ok());
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
  v1::ForwardResponse fwd;
  EXPECT_TRUE(Forward("a", 64, false, &fwd).ok());
  EXPECT_TRUE(Forward("b", 64, false, &fwd).ok());
}

TEST_F(FaultTest, StoppedWorkerIsDeclaredDead) {
  ASSERT_TRUE(Create("s").ok());
  ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));
  const absl::Time start = absl::Now();
  v1::ForwardResponse fwd;
  grpc::Status s = Forward("s", 16, false, &fwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(absl::Now() - start, kFailureBound);
  ExpectNotServingSoon();
  v1::GetStatusResponse status = Status();
  EXPECT_FALSE(status.workers(1).alive());
  EXPECT_THAT(status.workers(1).error(), HasSubstr("no answer"));
  ASSERT_TRUE(cluster_->RestartWorker(1).ok());  // kills the stopped one, starts a new one
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
  EXPECT_TRUE(Forward("s", 16, false, &fwd).ok());
}

TEST_F(FaultTest, CheckpointSurvivesFullRestart) {
  ASSERT_TRUE(Create("c").ok());
  {
    grpc::ClientContext ctx;
    v1::SetWeightsResponse response;
    auto writer = cluster_->stub()->SetWeights(&ctx, &response);
    std::vector<float> wo = RandomFloats(8 * 64 * 32, 77);
    Tensor tensor = Tensor::FromFloats({8, 64, 32}, wo);
    ChunkTensor("wo", tensor, 1 << 16, [&](const v1::TensorChunk& chunk) {
      v1::SetWeightsRequest request;
      request.set_layer("c");
      *request.mutable_chunk() = chunk;
      writer->Write(request);
      return absl::OkStatus();
    }).IgnoreError();
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
  }
  const std::string dir = "ckpt_restart";
  ASSERT_TRUE(Checkpoint("c", dir, /*save=*/true).ok());
  grpc::ClientContext ctx;
  v1::GetWeightsRequest request;
  request.set_layer("c");
  auto reader = cluster_->stub()->GetWeights(&ctx, request);
  grpc::Status status;
  auto saved = ReadChunks(reader.get(), &status);
  ASSERT_TRUE(status.ok());

  const std::string root = cluster_->checkpoint_root();
  // As if a save had been under way when moed was killed: staging of the old instance.
  std::string old_staging;
  for (const auto& entry : std::filesystem::directory_iterator(root + "/.staging")) {
    if (entry.is_directory()) old_staging = entry.path().string();
  }
  ASSERT_FALSE(old_staging.empty());
  std::filesystem::create_directories(old_staging + "/9");
  std::ofstream(old_staging + "/9/partial.bin") << "half a checkpoint";
  cluster_.reset();  // SIGKILL of moed and both workers
  ClusterOptions same_root;
  same_root.checkpoint_root = root;
  auto restarted = TestCluster::Start(same_root);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  cluster_ = std::move(*restarted);
  // The killed moed's staging is gone once the new one started.
  EXPECT_FALSE(std::filesystem::exists(old_staging));
  ASSERT_TRUE(Create("c").ok());
  ASSERT_TRUE(Checkpoint("c", dir, /*save=*/false).ok());
  grpc::ClientContext ctx2;
  auto reader2 = cluster_->stub()->GetWeights(&ctx2, request);
  auto loaded = ReadChunks(reader2.get(), &status);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(loaded, saved);
}

TEST_F(FaultTest, ResumedWorkerRejoinsByItself) {
  ASSERT_TRUE(Create("r").ok());
  {
    grpc::ClientContext ctx;
    v1::SetWeightsResponse response;
    auto writer = cluster_->stub()->SetWeights(&ctx, &response);
    Tensor wi = Tensor::FromFloats({8, 32, 128}, RandomFloats(8 * 32 * 128, 31));
    ChunkTensor("wi", wi, 1 << 20, [&](const v1::TensorChunk& chunk) {
      v1::SetWeightsRequest request;
      request.set_layer("r");
      *request.mutable_chunk() = chunk;
      writer->Write(request);
      return absl::OkStatus();
    }).IgnoreError();
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
  }
  const std::vector<float> before = Wi("r");
  // Worker 1's backend memory as of a heartbeat answered after `since`, once it satisfies
  // `ok` (-1 if it does not within 5 s).
  auto memory = [&](absl::Time since, const std::function<bool(int64_t)>& ok) -> int64_t {
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (absl::Now() < give_up) {
      v1::GetStatusResponse status = Status();
      const v1::WorkerStatus& w = status.workers(1);
      if (absl::Now() - absl::Milliseconds(w.last_seen_ms_ago()) > since && ok(w.memory_bytes())) {
        return w.memory_bytes();
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return -1;
  };
  const int64_t only_r =
      memory(absl::Now() + absl::Milliseconds(100), [](int64_t m) { return m > 0; });
  ASSERT_GT(only_r, 0);
  ASSERT_TRUE(Create("gone").ok());
  const int64_t with_gone =
      memory(absl::Now() + absl::Milliseconds(100), [&](int64_t m) { return m > only_r; });
  ASSERT_GT(with_gone, only_r);
  const int64_t generation = Status().generation();
  ASSERT_TRUE(cluster_->KillWorker(0, SIGSTOP));
  ExpectNotServingSoon();
  {
    // Deleted while the workers do not serve: they still hold it, and must drop it when the
    // cluster re-forms.
    grpc::ClientContext ctx;
    v1::DeleteLayerRequest request;
    request.set_name("gone");
    v1::DeleteLayerResponse response;
    ASSERT_TRUE(cluster_->stub()->DeleteLayer(&ctx, request, &response).ok());
  }
  kill(cluster_->worker_pid(0), SIGCONT);
  // Not pinged while declared dead, the worker joins again after --rejoin_after_s=2.
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(20)).ok());
  v1::ForwardResponse fwd;
  EXPECT_TRUE(Forward("r", 16, false, &fwd).ok());
  EXPECT_TRUE(Status().workers(0).alive());
  // The same processes re-formed: the layer kept its weights.
  EXPECT_GT(Status().generation(), generation);
  EXPECT_EQ(Wi("r"), before);
  EXPECT_FALSE(WeightsReset("r"));
  EXPECT_GT(memory(absl::Now() + absl::Milliseconds(100),
                   [&](int64_t m) { return m < (only_r + with_gone) / 2; }),
            0)
      << "the deleted layer's instance is still held (" << with_gone << " bytes with it, " << only_r
      << " without)";
}

// A state-changing call that fails on one worker after another applied it leaves the workers
// different: the layer says so and refuses what would use or persist that state until a
// checkpoint is loaded. Here rank 0 updates its expert bias while rank 1 is stopped. (A
// stopped worker no longer diverges an ApplyOptimizer: the step's read-only gradient check on
// every worker fails first, so no worker steps.)
TEST_F(FaultTest, PartialExpertBiasUpdateDivergesTheLayerUntilLoad) {
  ASSERT_TRUE(Create("d", /*expert_bias=*/true).ok());
  v1::ForwardResponse fwd;
  ASSERT_TRUE(Forward("d", 16, true, &fwd).ok());
  {
    grpc::ClientContext ctx;
    v1::BackwardRequest request;
    request.set_layer("d");
    request.set_step_id(fwd.step_id());
    *request.mutable_d_out() = FloatsToProto({16, 32}, RandomFloats(16 * 32, 6));
    v1::BackwardResponse response;
    ASSERT_TRUE(cluster_->stub()->Backward(&ctx, request, &response).ok());
  }
  const std::vector<float> saved = Wi("d");
  const std::string dir = "ckpt_diverged";
  ASSERT_TRUE(Checkpoint("d", dir, /*save=*/true).ok());
  auto diverged = [&] {
    grpc::ClientContext ctx;
    v1::GetLayerRequest request;
    request.set_name("d");
    v1::GetLayerResponse response;
    EXPECT_TRUE(cluster_->stub()->GetLayer(&ctx, request, &response).ok());
    return response.layer().diverged();
  };
  EXPECT_EQ(diverged(), "");

  ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));
  {
    grpc::ClientContext ctx;
    v1::UpdateExpertBiasRequest request;
    request.set_layer("d");
    request.set_rate(0.5);
    v1::UpdateExpertBiasResponse response;
    grpc::Status s = cluster_->stub()->UpdateExpertBias(&ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  EXPECT_THAT(diverged(), HasSubstr("UpdateExpertBias failed on some workers"));
  kill(cluster_->worker_pid(1), SIGCONT);
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(20)).ok());
  EXPECT_FALSE(WeightsReset("d"));  // the same processes: their (different) state is kept

  grpc::Status s = Forward("d", 16, false, &fwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("may hold different state"));
  EXPECT_THAT(s.error_message(), HasSubstr("LoadCheckpoint"));
  EXPECT_EQ(Checkpoint("d", dir + "_not_written", /*save=*/true).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  {
    grpc::ClientContext ctx;
    v1::GetWeightsRequest request;
    request.set_layer("d");
    auto reader = cluster_->stub()->GetWeights(&ctx, request);
    grpc::Status read;
    ReadChunks(reader.get(), &read);
    EXPECT_EQ(read.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }

  ASSERT_TRUE(Checkpoint("d", dir, /*save=*/false).ok());
  EXPECT_EQ(diverged(), "");
  EXPECT_EQ(Wi("d"), saved);
  EXPECT_TRUE(Forward("d", 16, false, &fwd).ok());
}

// Only gradients can differ after a failed ZeroGradients; the re-formation that follows the
// stopped worker's return drops every gradient, so the layer serves again without a load.
TEST_F(FaultTest, PartialZeroGradientsIsMendedByTheReformation) {
  ASSERT_TRUE(Create("z").ok());
  ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));
  {
    grpc::ClientContext ctx;
    v1::ZeroGradientsRequest request;
    request.set_layer("z");
    v1::ZeroGradientsResponse response;
    grpc::Status s = cluster_->stub()->ZeroGradients(&ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::GetLayerRequest request;
    request.set_name("z");
    v1::GetLayerResponse response;
    ASSERT_TRUE(cluster_->stub()->GetLayer(&ctx, request, &response).ok());
    EXPECT_THAT(response.layer().diverged(), HasSubstr("ZeroGradients failed on some workers"));
  }
  kill(cluster_->worker_pid(1), SIGCONT);
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(20)).ok());
  v1::ForwardResponse fwd;
  grpc::Status s = Forward("z", 16, false, &fwd);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace moe
