// moed's graceful stop (SIGTERM / SIGINT; issue 43, server/graceful_stop.h): a real moed with
// --state_dir and two CPU workers. A SIGTERM persists every layer changed since its durable
// checkpoint, and a restart on the same state directory holds the last acknowledged step bit
// for bit (weights and optimizer state); a step running at the signal finishes first; a
// durable write in flight at the signal finishes, and one cut short by a second signal leaves
// the previous checkpoint whole; calls arriving during the stop are UNAVAILABLE and readiness
// is NOT_SERVING while liveness stays SERVING.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
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

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

using client::MoeClient;
using Weights = std::map<std::string, std::string>;  // name -> raw fp32 bytes

// Its durable checkpoint (weights and SGD momentum, ~16 MB in 9 files, each fsynced) takes
// long enough to be caught in the middle of its write.
v1::LayerConfig MediumConfig(uint64_t seed) {
  v1::LayerConfig c = TinyConfig(seed);
  c.set_hidden(256);
  c.set_ffn(512);
  return c;
}

class GracefulStopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    sandbox_ = absl::StrCat(tmp ? tmp : "/tmp", "/graceful_", getpid(), "_",
                            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(sandbox_);
    fs::create_directories(sandbox_);
    state_dir_ = sandbox_ + "/state";
    log_ = sandbox_ + "/moed.log";
  }
  void TearDown() override {
    if (trainer_.joinable()) {  // a test that failed during its long step
      cluster_->KillWorker(1, SIGCONT);
      trainer_.join();
    }
  }

  // A cluster on state_dir_: durable only every 100 optimizer steps (the default) unless
  // `every_steps` says otherwise; no time trigger.
  void Start(int every_steps = 100) {
    client_.reset();
    cluster_.reset();
    ClusterOptions options;
    options.checkpoint_root = sandbox_ + "/checkpoints";
    options.moed_log = log_;
    options.moed_flags = {"--state_dir=" + state_dir_,
                          absl::StrCat("--durable_every_steps=", every_steps),
                          "--durable_every_s=0", "--shutdown_grace_s=20",
                          // A worker SIGSTOPped for a long step is not dead.
                          "--worker_dead_after_ms=10000"};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    auto client = MoeClient::Connect(cluster_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  // Forward (kept) and Backward of `tokens` rows of data `seed`: the gradients of one step.
  absl::Status ForwardBackward(const std::string& layer, int64_t hidden, int64_t tokens,
                               uint32_t seed) {
    Tensor x = Tensor::FromFloats({tokens, hidden}, RandomFloats(tokens * hidden, seed));
    auto forward = client_->Forward(layer, x, /*keep_for_backward=*/true);
    if (!forward.ok()) return forward.status();
    Tensor d_out = Tensor::FromFloats({tokens, hidden}, RandomFloats(tokens * hidden, seed + 7));
    return client_->Backward(layer, forward->step_id, d_out).status();
  }

  absl::Status Apply(const std::string& layer, v1::ApplyOptimizerResponse* response = nullptr) {
    v1::SgdOptimizer sgd;
    sgd.set_lr(0.05);
    sgd.set_momentum(0.9);  // optimizer state that must survive too
    v1::ApplyOptimizerResponse ignored;
    return client_->ApplySgd(layer, sgd, {}, response ? response : &ignored);
  }

  v1::ApplyOptimizerResponse Train(const std::string& layer, int64_t hidden, uint32_t seed) {
    v1::ApplyOptimizerResponse response;
    EXPECT_TRUE(ForwardBackward(layer, hidden, 24, seed).ok());
    EXPECT_TRUE(Apply(layer, &response).ok());
    return response;
  }

  Weights GetWeights(const std::string& layer) {
    Weights out;
    auto weights = client_->GetWeights(layer);
    EXPECT_TRUE(weights.ok()) << weights.status();
    if (!weights.ok()) return out;
    for (const NamedTensor& named : *weights) out[named.name] = std::string(named.tensor.bytes());
    return out;
  }

  v1::LayerInfo Info(const std::string& layer) {
    auto info = client_->GetLayer(layer);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : v1::LayerInfo();
  }

  // The tensor files of a SaveCheckpoint into the checkpoint root (router, experts: weights
  // and optimizer state), by name.
  std::map<std::string, std::string> CheckpointTensors(const std::string& layer,
                                                       const std::string& name) {
    std::map<std::string, std::string> files;
    auto saved = client_->SaveCheckpoint(layer, name);
    EXPECT_TRUE(saved.ok()) << saved.status();
    if (!saved.ok()) return files;
    for (const auto& entry : fs::directory_iterator(cluster_->checkpoint_root() + "/" + name)) {
      const std::string file = entry.path().filename().string();
      if (file.size() < 4 || file.substr(file.size() - 4) != ".bin") continue;
      std::ifstream in(entry.path(), std::ios::binary);
      files[file].assign(std::istreambuf_iterator<char>(in), {});
    }
    return files;
  }

  // Stops moed with `signal` and returns its exit status (moed is then gone; the workers are
  // SIGKILLed by the next Start or the fixture).
  int Stop(int signal = SIGTERM) {
    cluster_->NotifyMoed(signal);
    return cluster_->ReapMoed(absl::Seconds(30));
  }

  std::string Log() {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // A long step on `layer`: its Forward (kept) runs, then worker 1 is SIGSTOPped and trainer_
  // sends the Backward (it waits on that worker until SIGCONT; *backward_done: when it
  // answered), then an ApplyOptimizer (*after).
  void StartLongStep(const std::string& layer, absl::Status* backward, absl::Status* after,
                     absl::Time* backward_done) {
    const Tensor x = Tensor::FromFloats({24, 32}, RandomFloats(24 * 32, 11));
    auto forward = client_->Forward(layer, x, /*keep_for_backward=*/true);
    ASSERT_TRUE(forward.ok()) << forward.status();
    ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));
    const uint64_t step_id = forward->step_id;
    trainer_ = std::thread([=] {
      const Tensor d_out = Tensor::FromFloats({24, 32}, RandomFloats(24 * 32, 12));
      *backward = client_->Backward(layer, step_id, d_out).status();
      *backward_done = absl::Now();
      *after = Apply(layer);  // arrives during the stop
    });
    absl::SleepFor(absl::Milliseconds(300));  // the Backward reached moed and its workers
  }

  // Waits until a durable write has put an expert's file into the store's staging (the
  // workers are writing a checkpoint that is not in place yet).
  bool WaitForDurableWrite(absl::Duration timeout) {
    const std::string staging = state_dir_ + "/layers/.staging";
    const absl::Time give_up = absl::Now() + timeout;
    while (absl::Now() < give_up) {
      std::error_code error;
      for (fs::recursive_directory_iterator it(staging, error), end; !error && it != end;
           it.increment(error)) {
        // A checkpoint's tensor file (or its temporary), not the staging's own bookkeeping.
        if (it->path().filename().string().rfind("expert_", 0) == 0) return true;
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    return false;
  }

  std::string sandbox_, state_dir_, log_;
  std::unique_ptr<TestCluster> cluster_;
  std::unique_ptr<MoeClient> client_;
  std::thread trainer_;
};

TEST_F(GracefulStopTest, SigtermPersistsTheLastAcknowledgedStepBitForBit) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("a", TinyConfig(3)).ok());
  ASSERT_TRUE(client_->CreateLayer("b", TinyConfig(5)).ok());
  Train("a", 32, 1);
  Train("a", 32, 2);
  const v1::ApplyOptimizerResponse last = Train("a", 32, 3);
  ASSERT_EQ(last.optimizer_step(), 3);
  ASSERT_EQ(last.durable_optimizer_step(), 0);  // acknowledged, not durable: a crash loses it
  const Weights weights = GetWeights("a");
  const auto tensors = CheckpointTensors("a", "before");  // weights and momentum
  ASSERT_FALSE(tensors.empty());
  const Weights b_weights = GetWeights("b");

  EXPECT_EQ(Stop(SIGTERM), 0) << Log();
  const std::string log = Log();
  EXPECT_THAT(log, HasSubstr("layer a: persisted at optimizer step 3"));
  EXPECT_THAT(log, HasSubstr("layer b: unchanged since its durable optimizer step 0"));
  EXPECT_THAT(log, HasSubstr("1 layer(s) persisted, 1 already durable, 0 NOT persisted"));

  Start();  // the same state directory; new workers
  const v1::LayerInfo info = Info("a");
  EXPECT_EQ(info.optimizer_step(), 3);
  EXPECT_EQ(info.durable_optimizer_step(), 3);
  EXPECT_FALSE(info.weights_reset());
  EXPECT_TRUE(GetWeights("a") == weights) << "weights differ from the last acknowledged step";
  EXPECT_TRUE(CheckpointTensors("a", "after") == tensors)
      << "weights or optimizer state differ from the last acknowledged step";
  EXPECT_TRUE(GetWeights("b") == b_weights);
}

// A long step: its Backward waits on worker 1, SIGSTOPped, when SIGTERM arrives. It
// finishes once the worker goes on and answers OK; a call after it is UNAVAILABLE; the
// layer's last acknowledged step is persisted.
TEST_F(GracefulStopTest, SigtermDuringALongStepLetsItFinish) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("s", TinyConfig(7)).ok());
  ASSERT_EQ(Train("s", 32, 1).optimizer_step(), 1);
  const Weights weights = GetWeights("s");
  absl::Status backward, after;
  absl::Time backward_done;
  StartLongStep("s", &backward, &after, &backward_done);
  const absl::Time signalled = absl::Now();
  cluster_->NotifyMoed(SIGTERM);
  absl::SleepFor(absl::Milliseconds(300));  // the stop waits for the step
  ASSERT_TRUE(cluster_->KillWorker(1, SIGCONT));
  trainer_.join();
  EXPECT_TRUE(backward.ok()) << backward;
  EXPECT_GT(backward_done, signalled);
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  EXPECT_THAT(after.message(), HasSubstr("shutting down"));
  EXPECT_EQ(cluster_->ReapMoed(absl::Seconds(30)), 0) << Log();
  EXPECT_THAT(Log(), HasSubstr("layer s: persisted at optimizer step 1"));

  Start();
  EXPECT_EQ(Info("s").optimizer_step(), 1);
  EXPECT_TRUE(GetWeights("s") == weights);
}

// An automatic durable write (--durable_every_steps=1) in flight when SIGTERM arrives runs to
// its end; its ApplyOptimizer answers OK, durable; the stop has nothing left to write.
TEST_F(GracefulStopTest, SigtermDuringADurableWriteLetsItFinish) {
  Start(/*every_steps=*/1);
  ASSERT_TRUE(client_->CreateLayer("big", MediumConfig(8)).ok());
  ASSERT_TRUE(ForwardBackward("big", 256, 24, 1).ok());
  v1::ApplyOptimizerResponse response;
  absl::Status applied;
  std::thread trainer([&] { applied = Apply("big", &response); });
  const bool writing = WaitForDurableWrite(absl::Seconds(20));
  cluster_->NotifyMoed(SIGTERM);
  trainer.join();
  ASSERT_TRUE(writing) << "no durable write seen";
  ASSERT_TRUE(applied.ok()) << applied;
  EXPECT_EQ(response.optimizer_step(), 1);
  EXPECT_EQ(response.durable_optimizer_step(), 1);
  EXPECT_EQ(cluster_->ReapMoed(absl::Seconds(30)), 0) << Log();
  EXPECT_THAT(Log(), HasSubstr("layer big: unchanged since its durable optimizer step 1"));

  Start(/*every_steps=*/1);  // the start verifies every file of the checkpoint, then loads it
  EXPECT_EQ(Info("big").optimizer_step(), 1);
  EXPECT_FALSE(Info("big").weights_reset());
}

// The stop's own durable write cut short by a second signal: moed exits at once (status 1)
// naming the layer it did not persist, and the layer on disk is its previous durable
// checkpoint, whole: the restart loads it (a damaged one would make moed exit 2).
TEST_F(GracefulStopTest, SecondSignalDuringTheStopsWriteLeavesTheOldCheckpointWhole) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("big", MediumConfig(9)).ok());
  const Weights initial = GetWeights("big");  // durable: step 0, its init_seed
  ASSERT_EQ(Train("big", 256, 1).optimizer_step(), 1);
  cluster_->NotifyMoed(SIGTERM);
  ASSERT_TRUE(WaitForDurableWrite(absl::Seconds(20))) << Log();
  const int status = Stop(SIGINT);
  const std::string log = Log();
  ASSERT_EQ(status, 1) << "the write finished before the second signal: make it longer\n" << log;
  EXPECT_THAT(log, HasSubstr("layer big: NOT persisted"));
  EXPECT_THAT(log, HasSubstr("signal 2: exiting now with what is written"));
  EXPECT_THAT(log, Not(HasSubstr("layer big: persisted")));

  Start();
  const v1::LayerInfo info = Info("big");
  EXPECT_EQ(info.optimizer_step(), 0);
  EXPECT_FALSE(info.weights_reset());
  EXPECT_TRUE(GetWeights("big") == initial);
}

// During the stop (a long step keeps it going): readiness NOT_SERVING, liveness SERVING, a
// new call UNAVAILABLE naming the stop, unary and streamed alike; the books (GetLayer, which
// read nothing on the workers) still answer.
TEST_F(GracefulStopTest, CallsDuringTheStopAreRefusedAndReadinessIsNotServing) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("s", TinyConfig(10)).ok());
  ASSERT_TRUE(client_->CreateLayer("other", TinyConfig(4)).ok());
  absl::Status backward, after;
  absl::Time backward_done;
  StartLongStep("s", &backward, &after, &backward_done);
  cluster_->NotifyMoed(SIGTERM);
  absl::SleepFor(absl::Milliseconds(200));  // moed took the signal
  EXPECT_EQ(cluster_->Health("").value_or("error"), "NOT_SERVING");
  EXPECT_EQ(cluster_->Health("moe.v1.MoeService").value_or("error"), "NOT_SERVING");
  EXPECT_EQ(cluster_->Health("liveness").value_or("error"), "SERVING");
  const Tensor small = Tensor::FromFloats({8, 32}, RandomFloats(8 * 32, 1));
  auto refused = client_->Forward("other", small);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("moed is shutting down"));
  auto weights = client_->GetWeights("other");  // a server stream
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kUnavailable) << weights.status();
  EXPECT_THAT(weights.status().message(), HasSubstr("moed is shutting down"));
  auto created = client_->CreateLayer("late", TinyConfig(6));
  EXPECT_EQ(created.status().code(), absl::StatusCode::kUnavailable) << created.status();
  EXPECT_TRUE(client_->GetLayer("other").ok());
  ASSERT_TRUE(cluster_->KillWorker(1, SIGCONT));
  trainer_.join();
  EXPECT_TRUE(backward.ok()) << backward;  // accepted before the stop: it finished
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  EXPECT_EQ(cluster_->ReapMoed(absl::Seconds(30)), 0) << Log();
}

}  // namespace
}  // namespace moe
