// Durable layers (moed --state_dir; issue 14, finding 5; server/durable_store.h): a moed
// SIGKILLed with its workers and restarted on the same state directory serves every layer
// with the weights of its last durable optimizer step, bit for bit; a respawned worker's
// layers reload that state instead of init_seed; a damaged state directory or one of another
// format is refused (moed exits 2 naming the reason) without being changed; leftovers of a
// crash are removed; nothing outside the state directory is written; without --state_dir
// nothing is durable. Training goes through the C++ client (client/moe_client.h).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "client/moe_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/fs_snapshot.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using client::MoeClient;
using Weights = std::map<std::string, std::string>;  // name -> raw fp32 bytes

class DurableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    sandbox_ = absl::StrCat(tmp ? tmp : "/tmp", "/durable_", getpid(), "_",
                            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(sandbox_);
    fs::create_directories(sandbox_);
    state_dir_ = sandbox_ + "/state";
    checkpoint_root_ = sandbox_ + "/checkpoints";
  }

  // A cluster on state_dir_ (durable every 2 optimizer steps, no time trigger). embedded:
  // moed starts (and respawns) its own workers.
  void Start(bool durable = true, bool embedded = false) {
    client_.reset();
    cluster_.reset();
    ClusterOptions options;
    options.embedded = embedded;
    options.checkpoint_root = checkpoint_root_;
    if (durable) {
      options.moed_flags = {"--state_dir=" + state_dir_, "--durable_every_steps=2",
                            "--durable_every_s=0"};
    }
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    auto client = MoeClient::Connect(cluster_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  // One training step: Forward (kept), Backward, ApplyOptimizer (SGD).
  v1::ApplyOptimizerResponse Train(const std::string& layer, uint32_t seed) {
    v1::ApplyOptimizerResponse response;
    const int64_t tokens = 24;
    Tensor x = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, seed));
    auto forward = client_->Forward(layer, x, /*keep_for_backward=*/true);
    EXPECT_TRUE(forward.ok()) << forward.status();
    if (!forward.ok()) return response;
    Tensor d_out = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, seed + 1000));
    auto backward = client_->Backward(layer, forward->step_id, d_out);
    EXPECT_TRUE(backward.ok()) << backward.status();
    v1::SgdOptimizer sgd;
    sgd.set_lr(0.05);
    sgd.set_momentum(0.9);  // optimizer state that must survive too
    absl::Status applied = client_->ApplySgd(layer, sgd, {}, &response);
    EXPECT_TRUE(applied.ok()) << applied;
    return response;
  }

  // One training step as Train, stopping at the first failure; before phase `kill_at`
  // (0 forward, 1 backward, 2 optimizer; -1 none) worker `victim` is SIGKILLed.
  absl::Status TrainAttempt(const std::string& layer, uint32_t seed, int kill_at, int victim,
                            v1::ApplyOptimizerResponse* response) {
    const int64_t tokens = 24;
    auto kill = [&](int phase) {
      if (phase == kill_at) cluster_->KillWorker(victim, SIGKILL);
    };
    kill(0);
    Tensor x = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, seed));
    auto forward = client_->Forward(layer, x, /*keep_for_backward=*/true);
    if (!forward.ok()) return forward.status();
    kill(1);
    Tensor d_out = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, seed + 1000));
    auto backward = client_->Backward(layer, forward->step_id, d_out);
    if (!backward.ok()) return backward.status();
    kill(2);
    v1::SgdOptimizer sgd;
    sgd.set_lr(0.05);
    sgd.set_momentum(0.9);
    return client_->ApplySgd(layer, sgd, {}, response);
  }

  // Forward (kept) and Backward of data `seed`, without the optimizer step.
  void ForwardBackward(const std::string& layer, uint32_t seed) {
    const int64_t tokens = 24;
    Tensor x = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, seed));
    auto forward = client_->Forward(layer, x, /*keep_for_backward=*/true);
    ASSERT_TRUE(forward.ok()) << forward.status();
    Tensor d_out = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, seed + 1000));
    ASSERT_TRUE(client_->Backward(layer, forward->step_id, d_out).ok());
  }

  // ApplyOptimizer (SGD) with expected_optimizer_step = `expected`; the layer's step after it.
  grpc::Status ApplyExpecting(const std::string& layer, int64_t expected, int64_t* step) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    context.set_wait_for_ready(true);  // moed may just have restarted
    v1::ApplyOptimizerRequest request;
    request.set_layer(layer);
    request.mutable_sgd()->set_lr(0.05);
    request.set_expected_optimizer_step(expected);
    v1::ApplyOptimizerResponse response;
    grpc::Status status = client_->stub()->ApplyOptimizer(&context, request, &response);
    *step = status.ok() ? response.optimizer_step() : Info(layer).optimizer_step();
    return status;
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

  // Entries of a layer's durable folder L<n> ("c<sequence>" checkpoints).
  std::vector<std::string> Checkpoints() {
    std::vector<std::string> out;
    for (const auto& folder : fs::directory_iterator(state_dir_ + "/layers")) {
      const std::string name = folder.path().filename().string();
      if (name[0] != 'L' || name == "LOCK") continue;
      for (const auto& entry : fs::directory_iterator(folder.path())) {
        out.push_back(name + "/" + entry.path().filename().string());
      }
    }
    return out;
  }

  // Runs moed on state_dir_ alone (no workers) and returns its exit status and stderr.
  std::pair<int, std::string> RunMoedExpectingExit() {
    const std::string log = sandbox_ + "/moed.stderr";
    const std::vector<std::string> args = {RunfilePath("server/moed"),
                                           "--port=0",
                                           "--expect_workers=2",
                                           "--cluster_secret_file=" + TestClusterSecretFile(),
                                           "--checkpoint_root=" + checkpoint_root_,
                                           "--state_dir=" + state_dir_};
    const pid_t pid = fork();
    if (pid == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      _exit(127);
    }
    int status = 0;
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (absl::Now() > give_up) {  // it started serving: the refusal failed
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        return {-1, "moed did not exit"};
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    std::ifstream in(log);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1,
            std::string(std::istreambuf_iterator<char>(in), {})};
  }

  // A cluster trained to a durable step, then killed: layer "d", durable at step 2.
  void PrepareKilledState() {
    Start();
    ASSERT_TRUE(client_->CreateLayer("d", TinyConfig(9)).ok());
    Train("d", 1);
    ASSERT_EQ(Train("d", 2).durable_optimizer_step(), 2);
    client_.reset();
    cluster_.reset();  // SIGKILL
  }

  bool WaitNewGeneration(int64_t generation) {
    return cluster_->WaitNewGeneration(generation, absl::Seconds(30)).ok();
  }

  std::string sandbox_, state_dir_, checkpoint_root_;
  std::unique_ptr<TestCluster> cluster_;
  std::unique_ptr<MoeClient> client_;
};

TEST_F(DurableTest, RestartRestoresEveryLayerBitForBit) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("a", TinyConfig(3)).ok());
  ASSERT_TRUE(client_->CreateLayer("b", TinyConfig(5)).ok());
  const Weights a_init = GetWeights("a");
  const Weights b_init = GetWeights("b");
  EXPECT_EQ(Train("a", 1).durable_optimizer_step(), 0);
  v1::ApplyOptimizerResponse second = Train("a", 2);  // --durable_every_steps=2
  EXPECT_EQ(second.optimizer_step(), 2);
  EXPECT_EQ(second.durable_optimizer_step(), 2);
  Train("a", 3);
  v1::ApplyOptimizerResponse fourth = Train("a", 4);
  EXPECT_EQ(fourth.optimizer_step(), 4);
  EXPECT_EQ(fourth.durable_optimizer_step(), 4);
  const Weights a_durable = GetWeights("a");
  ASSERT_NE(a_durable, a_init);
  v1::ApplyOptimizerResponse fifth = Train("a", 5);  // acknowledged, not durable
  EXPECT_EQ(fifth.optimizer_step(), 5);
  EXPECT_EQ(fifth.durable_optimizer_step(), 4);
  ASSERT_NE(GetWeights("a"), a_durable);
  EXPECT_EQ(Train("b", 7).durable_optimizer_step(), 0);  // b: only its init_seed is durable
  v1::LayerInfo info = Info("a");
  EXPECT_TRUE(info.durable());
  EXPECT_EQ(info.optimizer_step(), 5);
  EXPECT_EQ(info.durable_optimizer_step(), 4);
  EXPECT_GT(info.durable_checkpoint_unix_ms(), 0);
  EXPECT_EQ(Checkpoints().size(), 2u);  // steps 2 and 4: the newest two kept

  // Leftovers of a crash: a registry write and a checkpoint save cut short.
  const std::string layers = state_dir_ + "/layers";
  const std::string a_folder = Checkpoints()[0].substr(0, Checkpoints()[0].find('/'));
  std::ofstream(layers + "/registry.tmp.4242.0") << "half a registry";
  const std::string orphan = layers + "/L999";  // a DeleteLayer cut short
  fs::create_directories(orphan + "/c00000000000000000999");
  const std::string newer = layers + "/" + a_folder + "/c00000000000000009999";
  fs::create_directories(newer);  // a save whose registry update never happened
  // Outside the state directory: nothing may change (the checkpoint root aside, which moed
  // uses for its own staging).
  fs::create_directories(sandbox_ + "/outside");
  std::ofstream(sandbox_ + "/outside/keep.txt") << "untouched";
  const auto outside = SnapshotTree(sandbox_ + "/outside");

  client_.reset();
  cluster_.reset();  // SIGKILL of moed and both workers
  Start();           // returns once SERVING: the layers are restored before that
  EXPECT_EQ(SnapshotTree(sandbox_ + "/outside"), outside);
  EXPECT_FALSE(fs::exists(layers + "/registry.tmp.4242.0"));
  EXPECT_FALSE(fs::exists(orphan));
  EXPECT_FALSE(fs::exists(newer));

  auto listed = client_->ListLayers();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  info = Info("a");
  EXPECT_TRUE(info.durable());
  EXPECT_FALSE(info.weights_reset());
  EXPECT_EQ(info.optimizer_step(), 4);  // step 5 was lost: it was not durable
  EXPECT_EQ(info.durable_optimizer_step(), 4);
  EXPECT_EQ(info.config().init_seed(), 3u);
  EXPECT_TRUE(GetWeights("a") == a_durable) << "weights differ from the durable step";
  EXPECT_EQ(Info("b").durable_optimizer_step(), 0);
  EXPECT_TRUE(GetWeights("b") == b_init);

  // Training continues from the durable state; step 6 is durable, the checkpoint of step 2
  // is pruned, and the next restart restores step 6.
  v1::ApplyOptimizerResponse again = Train("a", 5);
  EXPECT_EQ(again.optimizer_step(), 5);
  EXPECT_EQ(Train("a", 6).durable_optimizer_step(), 6);
  const Weights a_six = GetWeights("a");
  EXPECT_EQ(Checkpoints().size(), 2u);

  // DeleteLayer removes the layer's durable state; a restart does not bring it back.
  ASSERT_TRUE(client_->DeleteLayer("b").ok());
  EXPECT_EQ(Checkpoints().size(), 2u);  // a's only (b had none)
  client_.reset();
  cluster_.reset();
  Start();
  listed = client_->ListLayers();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "a");
  EXPECT_EQ((*listed)[0].durable_optimizer_step(), 6);
  EXPECT_TRUE(GetWeights("a") == a_six);
  ASSERT_TRUE(client_->DeleteLayer("a").ok());
  EXPECT_TRUE(Checkpoints().empty());
}

TEST_F(DurableTest, RespawnedWorkerReloadsTheDurableState) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("w", TinyConfig(4)).ok());
  const Weights init = GetWeights("w");
  Train("w", 1);
  ASSERT_EQ(Train("w", 2).durable_optimizer_step(), 2);
  const Weights durable = GetWeights("w");
  ASSERT_EQ(Train("w", 3).durable_optimizer_step(), 2);
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  const int64_t generation = status->generation();
  ASSERT_TRUE(cluster_->KillWorker(1, SIGKILL));
  ASSERT_TRUE(cluster_->RestartWorker(1).ok());
  ASSERT_TRUE(WaitNewGeneration(generation));
  const v1::LayerInfo info = Info("w");
  EXPECT_FALSE(info.weights_reset());
  EXPECT_EQ(info.optimizer_step(), 2);
  EXPECT_EQ(info.durable_optimizer_step(), 2);
  EXPECT_TRUE(info.durable_error().empty()) << info.durable_error();
  const Weights now = GetWeights("w");
  EXPECT_TRUE(now == durable) << "the respawned cluster does not hold the durable weights";
  EXPECT_FALSE(now == init);
}

// The same with moed's own workers: worker_launcher respawns the killed one.
TEST_F(DurableTest, WorkerRespawnedByMoedReloadsTheDurableState) {
  Start(/*durable=*/true, /*embedded=*/true);
  ASSERT_TRUE(client_->CreateLayer("e", TinyConfig(6)).ok());
  Train("e", 1);
  ASSERT_EQ(Train("e", 2).durable_optimizer_step(), 2);
  const Weights durable = GetWeights("e");
  Train("e", 3);
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_GT(status->workers(0).pid(), 0);
  ASSERT_EQ(::kill(static_cast<pid_t>(status->workers(0).pid()), SIGKILL), 0);
  ASSERT_TRUE(WaitNewGeneration(status->generation()));
  EXPECT_EQ(Info("e").optimizer_step(), 2);
  EXPECT_FALSE(Info("e").weights_reset());
  EXPECT_TRUE(GetWeights("e") == durable);
}

// Chaos (small): workers SIGKILLed at random phases of a training loop (seeded, so a failure
// reproduces). Every step acknowledged as durable survives, and the final weights equal, bit
// for bit, a fault-free replay (a fresh cluster of the same size) of the steps the layer kept,
// in order. Prints the figures.
TEST_F(DurableTest, ChaosKilledWorkersLoseNothingDurable) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("c", TinyConfig(8)).ok());
  std::mt19937 random(20261201);
  std::vector<uint32_t> kept;  // data seed of optimizer step i + 1
  int64_t acknowledged_durable = 0;
  int faults = 0, failed_calls = 0;
  std::map<int, int> codes;
  std::vector<double> recovery_s;
  for (uint32_t seed = 1; seed <= 14; ++seed) {
    const bool fault = random() % 3 == 0;
    const int kill_at = fault ? static_cast<int>(random() % 3) : -1;
    const int victim = static_cast<int>(random() % 2);
    auto before = client_->GetStatus();
    ASSERT_TRUE(before.ok());
    const int64_t step_before = Info("c").optimizer_step();
    v1::ApplyOptimizerResponse response;
    absl::Status status = TrainAttempt("c", seed, kill_at, victim, &response);
    if (status.ok()) {
      ASSERT_EQ(response.optimizer_step(), step_before + 1);
      kept.push_back(seed);
      acknowledged_durable = std::max(acknowledged_durable, response.durable_optimizer_step());
    } else {
      ++failed_calls;
      ++codes[static_cast<int>(status.code())];
    }
    if (kill_at < 0) continue;
    ++faults;
    const absl::Time killed = absl::Now();
    ASSERT_TRUE(cluster_->RestartWorker(victim).ok());
    ASSERT_TRUE(WaitNewGeneration(before->generation()));
    recovery_s.push_back(absl::ToDoubleSeconds(absl::Now() - killed));
    const v1::LayerInfo info = Info("c");
    EXPECT_FALSE(info.weights_reset());
    // Nothing acknowledged as durable is lost; what was not durable is gone.
    ASSERT_GE(info.optimizer_step(), acknowledged_durable);
    ASSERT_EQ(info.optimizer_step(), info.durable_optimizer_step());
    if (!status.ok() && info.optimizer_step() == step_before + 1) {
      kept.push_back(seed);  // applied and made durable, but the answer was lost
    }
    ASSERT_LE(info.optimizer_step(), static_cast<int64_t>(kept.size()));
    kept.resize(info.optimizer_step());
  }
  const Weights chaos = GetWeights("c");
  std::sort(recovery_s.begin(), recovery_s.end());
  std::string code_text;
  for (const auto& [code, n] : codes) absl::StrAppend(&code_text, " code ", code, ": ", n);
  std::printf(
      "chaos: %d faults, %d failed calls (%s), recovery p50 %.2f s max %.2f s, %zu "
      "steps kept of 14 attempts, replayed below\n",
      faults, failed_calls, code_text.c_str(),
      recovery_s.empty() ? 0.0 : recovery_s[recovery_s.size() / 2],
      recovery_s.empty() ? 0.0 : recovery_s.back(), kept.size());
  EXPECT_GT(faults, 0);

  // The replay: the kept steps in order on a fresh, fault-free cluster of the same size.
  Start(/*durable=*/false);
  ASSERT_TRUE(client_->CreateLayer("c", TinyConfig(8)).ok());
  for (uint32_t seed : kept) Train("c", seed);
  EXPECT_TRUE(GetWeights("c") == chaos) << "the chaos run's weights differ from the replay";
}

// ApplyOptimizer's expected_optimizer_step: a trainer that retries never has a step applied
// on another step than the one it computed for, nor from gradients a re-formation or a moed
// restart dropped (tests/chaos/chaos_test.cc relies on it).
TEST_F(DurableTest, ConditionalStepRefusesAnotherStepAndDroppedGradients) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("g", TinyConfig(12)).ok());
  int64_t step = 0;
  ForwardBackward("g", 1);
  grpc::Status applied = ApplyExpecting("g", 1, &step);
  EXPECT_EQ(applied.error_code(), grpc::StatusCode::ABORTED) << applied.error_message();
  EXPECT_THAT(applied.error_message(), HasSubstr("at optimizer step 0, not 1"));
  EXPECT_EQ(step, 0);
  ASSERT_TRUE(ApplyExpecting("g", 0, &step).ok());
  EXPECT_EQ(step, 1);

  // A re-formation (a worker replaced) dropped the gradients of the step: refused until a
  // ZeroGradients, then the step runs again.
  ForwardBackward("g", 2);
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok());
  ASSERT_TRUE(cluster_->KillWorker(1, SIGKILL));
  ASSERT_TRUE(cluster_->RestartWorker(1).ok());
  ASSERT_TRUE(WaitNewGeneration(status->generation()));
  ASSERT_EQ(Info("g").optimizer_step(), 0);  // durable every 2 steps: back to step 0
  applied = ApplyExpecting("g", 0, &step);
  EXPECT_EQ(applied.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(applied.error_message(), HasSubstr("dropped its gradients"));
  EXPECT_EQ(step, 0);
  ASSERT_TRUE(client_->ZeroGradients("g").ok());
  ForwardBackward("g", 1);
  ASSERT_TRUE(ApplyExpecting("g", 0, &step).ok());
  ForwardBackward("g", 2);
  ASSERT_TRUE(ApplyExpecting("g", 1, &step).ok());
  EXPECT_EQ(Info("g").durable_optimizer_step(), 2);

  // A moed restart: the restored layer's gradients are gone too.
  ForwardBackward("g", 3);
  ASSERT_TRUE(cluster_->RestartMoed().ok());
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
  applied = ApplyExpecting("g", 2, &step);
  EXPECT_EQ(applied.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(applied.error_message(), HasSubstr("dropped its gradients"));
  EXPECT_EQ(step, 2);
  ASSERT_TRUE(client_->ZeroGradients("g").ok());
  ForwardBackward("g", 3);
  ASSERT_TRUE(ApplyExpecting("g", 2, &step).ok());
  EXPECT_EQ(step, 3);
}

// A durable layer diverged by a worker lost in the middle of UpdateExpertBias, which then
// comes back as the same process (SIGSTOP, SIGCONT), is repaired from its durable state at the
// re-formation instead of keeping its workers' mixed weights. (An ApplyOptimizer no longer
// diverges this way: its read-only gradient check on every worker fails first, so no worker
// steps.)
TEST_F(DurableTest, DivergedLayerIsRepairedFromItsDurableState) {
  Start();
  v1::LayerConfig config = TinyConfig(13);
  config.set_score_function(v1::SCORE_FUNCTION_SIGMOID);
  config.set_use_expert_bias(true);
  ASSERT_TRUE(client_->CreateLayer("v", config).ok());
  Train("v", 1);
  ASSERT_EQ(Train("v", 2).durable_optimizer_step(), 2);
  const Weights durable = GetWeights("v");
  Train("v", 3);
  ForwardBackward("v", 4);
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok());
  ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));
  // Worker 0 applied it, worker 1 did not.
  EXPECT_FALSE(client_->UpdateExpertBias("v", 0.01).ok());
  EXPECT_THAT(Info("v").diverged(), HasSubstr("UpdateExpertBias"));
  ASSERT_TRUE(cluster_->KillWorker(1, SIGCONT));  // the same process rejoins
  ASSERT_TRUE(WaitNewGeneration(status->generation()));
  const v1::LayerInfo info = Info("v");
  EXPECT_TRUE(info.diverged().empty()) << info.diverged();
  EXPECT_FALSE(info.weights_reset());
  EXPECT_EQ(info.optimizer_step(), 2);
  EXPECT_TRUE(GetWeights("v") == durable) << "the repaired layer does not hold the durable step";
}

// moed relays step tensors to workers on its host through its shared-memory buffers
// (--shm_relay, server/relay_pool.h), whose region ids start again in every moed. Workers that
// outlive a moed restart must not keep using their mappings of the dead moed's buffers: the
// same input gives the same output before and after the restart (found by chaos_test).
TEST_F(DurableTest, RelayAfterMoedRestartReadsTheNewBuffers) {
  Start();
  ASSERT_TRUE(client_->CreateLayer("r", TinyConfig(14)).ok());
  const int64_t tokens = 24;
  const Tensor x = Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, 5));
  auto before = client_->Forward("r", x);
  ASSERT_TRUE(before.ok()) << before.status();
  // Another input through the same buffers, so that the dead moed's last bytes differ from x.
  ASSERT_TRUE(
      client_->Forward("r", Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, 6))).ok());
  ASSERT_TRUE(cluster_->RestartMoed().ok());  // the workers stay and rejoin
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
  client::CallOptions wait;
  wait.wait_for_ready = true;
  auto after = client_->Forward("r", x, /*keep_for_backward=*/false, wait);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(TensorFloats(after->out), TensorFloats(before->out))
      << "a worker used a buffer of the moed that was killed";
}

TEST_F(DurableTest, DamagedCheckpointIsRefusedAndNothingChanges) {
  PrepareKilledState();
  std::vector<std::string> checkpoints = Checkpoints();
  ASSERT_EQ(checkpoints.size(), 1u);
  const std::string expert = state_dir_ + "/layers/" + checkpoints[0] + "/expert_00003.bin";
  {
    std::fstream file(expert, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(200);
    char byte = 0;
    file.read(&byte, 1);
    byte ^= 0x10;
    file.seekp(200);
    file.write(&byte, 1);
  }
  std::ofstream(state_dir_ + "/layers/registry.tmp.77.0") << "leftover";
  const auto before = SnapshotTree(state_dir_);
  auto [code, log] = RunMoedExpectingExit();
  EXPECT_EQ(code, 2) << log;
  EXPECT_THAT(log, HasSubstr("expert_00003.bin"));
  EXPECT_THAT(log, HasSubstr("refuses to start on a damaged state directory"));
  EXPECT_EQ(SnapshotTree(state_dir_), before);  // refused before cleaning anything
}

TEST_F(DurableTest, DamagedRegistryIsRefused) {
  PrepareKilledState();
  const std::string registry = state_dir_ + "/layers/registry";
  std::string text;
  {
    std::ifstream in(registry);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  text[text.find("layer ") + 6] ^= 1;  // the incarnation's digit
  std::ofstream(registry, std::ios::trunc) << text;
  auto [code, log] = RunMoedExpectingExit();
  EXPECT_EQ(code, 2) << log;
  EXPECT_THAT(log, HasSubstr("checksum does not match"));
  EXPECT_THAT(log, HasSubstr(registry));
}

TEST_F(DurableTest, OtherFormatVersionIsRefused) {
  PrepareKilledState();
  std::ofstream(state_dir_ + "/layers/FORMAT", std::ios::trunc) << "moed durable layers v9\n";
  const auto before = SnapshotTree(state_dir_);
  auto [code, log] = RunMoedExpectingExit();
  EXPECT_EQ(code, 2) << log;
  EXPECT_THAT(log, HasSubstr("another version of moed"));
  EXPECT_THAT(log, HasSubstr("v9"));
  EXPECT_EQ(SnapshotTree(state_dir_), before);
}

TEST_F(DurableTest, WithoutStateDirNothingIsDurable) {
  Start(/*durable=*/false);
  ASSERT_TRUE(client_->CreateLayer("n", TinyConfig(2)).ok());
  Train("n", 1);
  const v1::ApplyOptimizerResponse response = Train("n", 2);
  EXPECT_EQ(response.optimizer_step(), 2);
  EXPECT_EQ(response.durable_optimizer_step(), 0);
  EXPECT_FALSE(Info("n").durable());
  EXPECT_FALSE(fs::exists(state_dir_));
}

}  // namespace
}  // namespace moe
