// MoeClient (client/moe_client.h) against a real moed with 2 embedded CPU workers: every RPC
// of moe.v1.MoeService and the health check, chunked streams with chunks far smaller than the
// tensors, status codes preserved from the server, deadlines, and one client shared by
// several threads.
//
// Usage (from Bazel): moe_client_test MOED MOE_WORKER
#include "client/moe_client.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/tensor_util.h"
#include "gtest/gtest.h"

namespace moe {
namespace client {
namespace {

std::string g_moed;
std::string g_worker;

// moed in its own process group, killed as a group at the end.
class Cluster {
 public:
  bool Start() {
    const std::string dir = ::testing::TempDir();
    const std::string port_file = dir + "/moed.port";
    std::remove(port_file.c_str());
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      const std::string log = dir + "/moed.log";
      if (std::freopen(log.c_str(), "w", stderr) == nullptr) _exit(126);  // no log, no run
      std::vector<std::string> args = {g_moed,
                                       "--listen=127.0.0.1",
                                       "--port=0",
                                       "--port_file=" + port_file,
                                       "--checkpoint_root=" + dir + "/checkpoints",
                                       "--workers=2",
                                       "--worker_binary=" + g_worker};
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (absl::Now() < give_up) {
      std::ifstream in(port_file);
      int port = 0;
      if (in >> port && port > 0) {
        address_ = absl::StrCat("127.0.0.1:", port);
        return true;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }
  void Stop() {
    if (pid_ <= 0) return;
    kill(-pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    kill(-pid_, SIGKILL);
    waitpid(pid_, nullptr, WNOHANG);
    pid_ = -1;
  }
  const std::string& address() const { return address_; }

 private:
  pid_t pid_ = -1;
  std::string address_;
};

class MoeClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new Cluster();
    ASSERT_TRUE(cluster_->Start()) << "moed did not start";
    auto client = MoeClient::Connect(cluster_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    // SERVING once both workers joined and set up.
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    absl::StatusOr<ServingStatus> health;
    do {
      CallOptions call;
      call.deadline = absl::Seconds(2);
      call.wait_for_ready = true;
      health = (*client)->Health("", call);
      if (health.ok() && *health == ServingStatus::kServing) break;
      absl::SleepFor(absl::Milliseconds(100));
    } while (absl::Now() < give_up);
    ASSERT_TRUE(health.ok()) << health.status();
    ASSERT_EQ(*health, ServingStatus::kServing);
  }
  static void TearDownTestSuite() {
    cluster_->Stop();
    delete cluster_;
  }

  void SetUp() override {
    ClientOptions small_chunks;
    small_chunks.chunk_bytes = 1000;  // every weight tensor below spans many chunks
    auto client = MoeClient::Connect(cluster_->address(), small_chunks);
    ASSERT_TRUE(client.ok());
    client_ = *std::move(client);
  }

  static v1::LayerConfig TinyConfig() {
    v1::LayerConfig config;
    config.set_hidden(32);
    config.set_ffn(48);
    config.set_num_experts(4);
    config.set_top_k(2);
    config.set_init_seed(5);
    return config;
  }

  static Cluster* cluster_;
  std::unique_ptr<MoeClient> client_;
};

Cluster* MoeClientTest::cluster_ = nullptr;

const Tensor* Find(const std::vector<NamedTensor>& tensors, const std::string& name) {
  for (const NamedTensor& t : tensors) {
    if (t.name == name) return &t.tensor;
  }
  return nullptr;
}

TEST(DefaultLanes, TheHostsCoresUpTo16AndNoneOnTinyHosts) {
  EXPECT_EQ(DefaultLanes(0), 1);  // hardware_concurrency() unknown
  EXPECT_EQ(DefaultLanes(1), 1);
  EXPECT_EQ(DefaultLanes(2), 1);
  EXPECT_EQ(DefaultLanes(3), 3);
  EXPECT_EQ(DefaultLanes(16), 16);
  EXPECT_EQ(DefaultLanes(128), 16);
}

TEST_F(MoeClientTest, HealthAndStatus) {
  EXPECT_EQ(*client_->Health(), ServingStatus::kServing);
  EXPECT_EQ(*client_->Health("moe.v1.MoeService"), ServingStatus::kServing);
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status->serving());
  EXPECT_EQ(status->world_size(), 2);
  EXPECT_EQ(status->workers_size(), 2);
}

TEST_F(MoeClientTest, LayerLifecycleAndErrorCodes) {
  auto info = client_->CreateLayer("life", TinyConfig());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->ep_ranks(), 2);
  EXPECT_EQ(info->config().top_k(), 2);
  EXPECT_EQ(client_->CreateLayer("life", TinyConfig()).status().code(),
            absl::StatusCode::kAlreadyExists);
  v1::LayerConfig bad = TinyConfig();
  bad.set_top_k(9);
  EXPECT_EQ(client_->CreateLayer("bad", bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetLayer("life")->name(), "life");
  auto layers = client_->ListLayers();
  ASSERT_TRUE(layers.ok());
  bool listed = false;
  for (const auto& l : *layers) listed = listed || l.name() == "life";
  EXPECT_TRUE(listed);
  EXPECT_TRUE(client_->DeleteLayer("life").ok());
  EXPECT_EQ(client_->GetLayer("life").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DeleteLayer("life").code(), absl::StatusCode::kNotFound);
}

TEST_F(MoeClientTest, StepsReleaseAndDeadlines) {
  ASSERT_TRUE(client_->CreateLayer("steps", TinyConfig()).ok());
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor x = RandomNormal(dtype, {10, 32}, 3);
    auto fwd = client_->Forward("steps", x, /*keep_for_backward=*/true);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_EQ(fwd->out.dtype(), dtype);
    EXPECT_EQ(fwd->out.shape(), x.shape());
    ASSERT_NE(fwd->step_id, 0u);
    int64_t pairs = 0;
    for (int64_t n : fwd->tokens_per_expert) pairs += n;
    EXPECT_EQ(pairs, 10 * 2);
    auto d_x = client_->Backward("steps", fwd->step_id, RandomNormal(dtype, {10, 32}, 4));
    ASSERT_TRUE(d_x.ok()) << d_x.status();
    EXPECT_EQ(d_x->shape(), x.shape());
    EXPECT_EQ(client_->Backward("steps", fwd->step_id, x).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  const Tensor x = RandomNormal(DType::kFloat32, {6, 32}, 5);
  auto kept = client_->Forward("steps", x, true);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*client_->ReleaseStep("steps", kept->step_id), true);
  EXPECT_EQ(*client_->ReleaseStep("steps", kept->step_id), false);
  EXPECT_EQ(client_->Backward("steps", kept->step_id, x).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Wrong hidden size and unknown layer come back with the server's codes.
  EXPECT_EQ(client_->Forward("steps", RandomNormal(DType::kFloat32, {6, 31}, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Forward("nope", x).status().code(), absl::StatusCode::kNotFound);
  // A deadline that passed before the call started. (gRPC rounds deadlines up to whole
  // milliseconds, and a forward this small can finish inside one on localhost, so a "very
  // short" deadline would make this test flaky.)
  CallOptions hurry;
  hurry.deadline = absl::Seconds(-1);
  EXPECT_EQ(client_->Forward("steps", x, false, hurry).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(client_->DeleteLayer("steps").ok());
}

// A client whose message limit is far below the tensors streams Forward and Backward in
// pieces (ForwardStream / BackwardStream); the results are bit-identical to the unary calls.
TEST_F(MoeClientTest, StepsLargerThanOneMessageAreStreamedBitIdentically) {
  ClientOptions tiny_messages;
  tiny_messages.max_message_bytes = 1 << 16;  // the lowest; pieces of 4 KiB
  auto streaming = MoeClient::Connect(cluster_->address(), tiny_messages);
  ASSERT_TRUE(streaming.ok());
  ASSERT_TRUE(client_->CreateLayer("big", TinyConfig()).ok());
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    // 1001 x 32 fp32 = 128 KB: two messages' worth, split over the 2 workers unevenly.
    const Tensor x = RandomNormal(dtype, {1001, 32}, 11);
    const Tensor d_out = RandomNormal(dtype, {1001, 32}, 12);
    auto unary = client_->Forward("big", x, /*keep_for_backward=*/true);
    ASSERT_TRUE(unary.ok()) << unary.status();
    StepTimes times;
    CallOptions timed;
    timed.timing = &times;
    auto streamed = (*streaming)->Forward("big", x, /*keep_for_backward=*/true, timed);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    EXPECT_EQ(streamed->out.shape(), x.shape());
    EXPECT_EQ(streamed->out.bytes(), unary->out.bytes());
    EXPECT_EQ(streamed->aux_loss, unary->aux_loss);
    EXPECT_EQ(streamed->tokens_per_expert, unary->tokens_per_expert);
    EXPECT_EQ(times.server.workers_size(), 2);  // the timing asked for came back too
    auto d_x_unary = client_->Backward("big", unary->step_id, d_out);
    auto d_x_streamed = (*streaming)->Backward("big", streamed->step_id, d_out);
    ASSERT_TRUE(d_x_unary.ok()) << d_x_unary.status();
    ASSERT_TRUE(d_x_streamed.ok()) << d_x_streamed.status();
    EXPECT_EQ(d_x_streamed->bytes(), d_x_unary->bytes());
  }
  // The streamed call validates like the unary one.
  EXPECT_EQ(
      (*streaming)->Forward("big", RandomNormal(DType::kFloat32, {600, 31}, 1)).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      (*streaming)->Forward("nope", RandomNormal(DType::kFloat32, {600, 32}, 1)).status().code(),
      absl::StatusCode::kNotFound);
  ASSERT_TRUE(client_->DeleteLayer("big").ok());
}

// CallOptions::output: out and d_x are written into the caller's buffers, bit-identical to
// the newly allocated results, over one call, the streamed calls and the staged lanes; a
// buffer of the wrong datatype or shape is refused before anything is sent.
TEST_F(MoeClientTest, StepsWriteIntoTheCallersOutputOnEveryPath) {
  ASSERT_TRUE(client_->CreateLayer("into", TinyConfig()).ok());
  ClientOptions tiny_messages;
  tiny_messages.max_message_bytes = 1 << 16;
  ClientOptions lanes;
  lanes.lanes = 2;
  lanes.lane_min_bytes = 1;
  auto streaming = MoeClient::Connect(cluster_->address(), tiny_messages);
  auto laned = MoeClient::Connect(cluster_->address(), lanes);
  ASSERT_TRUE(streaming.ok() && laned.ok());
  const std::vector<std::pair<const char*, MoeClient*>> paths = {
      {"one call", client_.get()}, {"streamed", streaming->get()}, {"lanes", laned->get()}};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor x = RandomNormal(dtype, {1001, 32}, 21);
    const Tensor d_out = RandomNormal(dtype, {1001, 32}, 22);
    auto want = client_->Forward("into", x, /*keep_for_backward=*/true);
    ASSERT_TRUE(want.ok()) << want.status();
    auto want_d_x = client_->Backward("into", want->step_id, d_out);
    ASSERT_TRUE(want_d_x.ok()) << want_d_x.status();
    for (const auto& [path, client] : paths) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), ", ", path));
      Tensor out_buffer = Tensor::Zeros(dtype, x.shape());
      Tensor d_x_buffer = Tensor::Zeros(dtype, x.shape());
      for (int step = 0; step < 2; ++step) {  // the same buffers again
        CallOptions into_out, into_d_x;
        into_out.output = &out_buffer;
        into_d_x.output = &d_x_buffer;
        auto fwd = client->Forward("into", x, /*keep_for_backward=*/true, into_out);
        ASSERT_TRUE(fwd.ok()) << fwd.status();
        EXPECT_EQ(fwd->out.raw(), out_buffer.raw());
        EXPECT_EQ(fwd->out.shape(), x.shape());
        EXPECT_EQ(out_buffer.bytes(), want->out.bytes());
        auto d_x = client->Backward("into", fwd->step_id, d_out, std::nullopt, std::nullopt,
                                    into_d_x);
        ASSERT_TRUE(d_x.ok()) << d_x.status();
        EXPECT_EQ(d_x->raw(), d_x_buffer.raw());
        EXPECT_EQ(d_x_buffer.bytes(), want_d_x->bytes());
      }
    }
  }
  // Refused before the call: the unknown layer would otherwise be NOT_FOUND.
  const Tensor x = RandomNormal(DType::kFloat32, {8, 32}, 1);
  Tensor wrong_shape = Tensor::Zeros(DType::kFloat32, {8, 31});
  Tensor wrong_dtype = Tensor::Zeros(DType::kBFloat16, {8, 32});
  for (Tensor* wrong : {&wrong_shape, &wrong_dtype}) {
    CallOptions call;
    call.output = wrong;
    const absl::Status fwd = client_->Forward("nope", x, false, call).status();
    EXPECT_EQ(fwd.code(), absl::StatusCode::kInvalidArgument) << fwd;
    EXPECT_NE(fwd.message().find("CallOptions::output"), absl::string_view::npos) << fwd;
    EXPECT_EQ(client_->Backward("nope", 1, x, std::nullopt, std::nullopt, call).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  ASSERT_TRUE(client_->DeleteLayer("into").ok());
}

TEST_F(MoeClientTest, WeightsRoundTripThroughSmallChunks) {
  ASSERT_TRUE(client_->CreateLayer("weights", TinyConfig()).ok());
  auto weights = client_->GetWeights("weights");
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_NE(Find(*weights, "wi"), nullptr);
  EXPECT_EQ(Find(*weights, "wi")->shape(), (std::vector<int64_t>{4, 32, 96}));
  // Scale every tensor by 2 (exact in fp32), send it back in 1000-byte chunks, read it again.
  std::vector<NamedTensor> doubled = *weights;
  for (NamedTensor& t : doubled) {
    for (int64_t i = 0; i < t.tensor.num_elements(); ++i) t.tensor.data<float>()[i] *= 2.0f;
  }
  auto updated = client_->SetWeights("weights", doubled);
  ASSERT_TRUE(updated.ok()) << updated.status();
  EXPECT_EQ(updated->size(), doubled.size());
  auto back = client_->GetWeights("weights", {"wo", "gate"});
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[0].name, "wo");
  EXPECT_EQ((*back)[0].tensor.bytes(), Find(doubled, "wo")->bytes());
  EXPECT_EQ((*back)[1].tensor.bytes(), Find(doubled, "gate")->bytes());
  // A tensor of the wrong shape is refused and nothing is applied.
  std::vector<NamedTensor> wrong = {{"gate", Tensor::Zeros(DType::kFloat32, {4, 32})}};
  EXPECT_EQ(client_->SetWeights("weights", wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetWeights("weights", {"gate"})->at(0).tensor.bytes(),
            Find(doubled, "gate")->bytes());
  EXPECT_EQ(client_->GetWeights("nope").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(client_->DeleteLayer("weights").ok());
}

TEST_F(MoeClientTest, GradientsOptimizersAndCheckpoints) {
  ASSERT_TRUE(client_->CreateLayer("train", TinyConfig()).ok());
  const Tensor x = RandomNormal(DType::kFloat32, {12, 32}, 7);
  auto fwd = client_->Forward("train", x, true);
  ASSERT_TRUE(fwd.ok());
  ASSERT_TRUE(
      client_->Backward("train", fwd->step_id, RandomNormal(DType::kFloat32, {12, 32}, 8)).ok());
  auto grads = client_->GetGradients("train");
  ASSERT_TRUE(grads.ok()) << grads.status();
  ASSERT_NE(Find(*grads, "wi"), nullptr);
  double norm = 0;
  for (float g : ToFloatVector(*Find(*grads, "wi"))) norm += g * g;
  EXPECT_GT(norm, 0.0);

  // SGD: w' = w - lr * g, checked against the weights and gradients read before the step.
  auto before = client_->GetWeights("train");
  ASSERT_TRUE(before.ok());
  v1::SgdOptimizer sgd;
  sgd.set_lr(0.25);
  ASSERT_TRUE(client_->ApplySgd("train", sgd).ok());
  auto after = client_->GetWeights("train");
  ASSERT_TRUE(after.ok());
  for (const std::string name : {"gate", "wi", "wo"}) {
    const Tensor& w0 = *Find(*before, name);
    const Tensor& g = *Find(*grads, name);
    Tensor expected = w0;
    for (int64_t i = 0; i < w0.num_elements(); ++i) {
      expected.data<float>()[i] = w0.data<float>()[i] - 0.25f * g.data<float>()[i];
    }
    EXPECT_LT(*MaxRelError(*Find(*after, name), expected), 1e-6) << name;
  }
  // The step zeroed the gradients.
  auto zeroed = client_->GetGradients("train");
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  for (const NamedTensor& g : *zeroed) {
    for (float v : ToFloatVector(g.tensor)) ASSERT_EQ(v, 0.0f) << g.name;
  }

  const std::string dir = "client/ckpt";  // inside moed's --checkpoint_root
  auto saved = client_->SaveCheckpoint("train", dir);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(*saved, dir);
  v1::AdamWOptimizer adamw;
  adamw.set_lr(0.01);
  auto fwd2 = client_->Forward("train", x, true);
  ASSERT_TRUE(client_->Backward("train", fwd2->step_id, x).ok());
  ASSERT_TRUE(client_->ApplyAdamW("train", adamw).ok());
  EXPECT_NE(client_->GetWeights("train", {"wi"})->at(0).tensor.bytes(),
            Find(*after, "wi")->bytes());
  ASSERT_TRUE(client_->LoadCheckpoint("train", dir).ok());
  auto restored = client_->GetWeights("train");
  ASSERT_TRUE(restored.ok()) << restored.status();
  for (const NamedTensor& w : *restored) {
    EXPECT_EQ(w.tensor.bytes(), Find(*after, w.name)->bytes()) << w.name;
  }
  ASSERT_TRUE(client_->ZeroGradients("train").ok());
  // Expert bias needs a sigmoid layer with use_expert_bias.
  EXPECT_EQ(client_->UpdateExpertBias("train", 0.1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client_->DeleteLayer("train").ok());

  v1::LayerConfig biased = TinyConfig();
  biased.set_score_function(v1::SCORE_FUNCTION_SIGMOID);
  biased.set_use_expert_bias(true);
  ASSERT_TRUE(client_->CreateLayer("biased", biased).ok());
  ASSERT_TRUE(client_->Forward("biased", x).ok());
  auto bias = client_->UpdateExpertBias("biased", 0.1);
  ASSERT_TRUE(bias.ok()) << bias.status();
  ASSERT_EQ(bias->size(), 4u);
  for (float b : *bias) EXPECT_TRUE(b == 0.0f || std::fabs(std::fabs(b) - 0.1f) < 1e-6) << b;
  ASSERT_TRUE(client_->DeleteLayer("biased").ok());
}

// expected_optimizer_step: a step expected on another optimizer step than the layer's is
// ABORTED and changes nothing (weights, gradients, the step count); the right one applies.
TEST_F(MoeClientTest, ConditionalStepRefusesAnotherStep) {
  ASSERT_TRUE(client_->CreateLayer("cond", TinyConfig()).ok());
  const Tensor x = RandomNormal(DType::kFloat32, {12, 32}, 9);
  auto fwd = client_->Forward("cond", x, true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_TRUE(client_->Backward("cond", fwd->step_id, x).ok());
  auto before = client_->GetWeights("cond");
  auto grads = client_->GetGradients("cond");
  ASSERT_TRUE(before.ok() && grads.ok());
  auto info = client_->GetLayer("cond");
  ASSERT_TRUE(info.ok());
  ASSERT_EQ(info->optimizer_step(), 0);

  v1::SgdOptimizer sgd;
  sgd.set_lr(0.25);
  v1::ApplyOptimizerResponse answer;
  absl::Status refused = client_->ApplySgd("cond", sgd, {}, &answer, /*expected=*/3);
  EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
  EXPECT_NE(refused.message().find("nothing applied"), absl::string_view::npos) << refused;
  v1::AdamWOptimizer adamw;
  adamw.set_lr(0.01);
  EXPECT_EQ(client_->ApplyAdamW("cond", adamw, {}, &answer, /*expected=*/1).code(),
            absl::StatusCode::kAborted);
  auto unchanged = client_->GetWeights("cond");
  auto grads_kept = client_->GetGradients("cond");
  ASSERT_TRUE(unchanged.ok() && grads_kept.ok());
  for (const NamedTensor& w : *unchanged) {
    EXPECT_EQ(w.tensor.bytes(), Find(*before, w.name)->bytes()) << w.name;
  }
  for (const NamedTensor& g : *grads_kept) {
    EXPECT_EQ(g.tensor.bytes(), Find(*grads, g.name)->bytes()) << g.name;
  }
  EXPECT_EQ(client_->GetLayer("cond")->optimizer_step(), 0);

  ASSERT_TRUE(client_->ApplySgd("cond", sgd, {}, &answer, /*expected=*/0).ok());
  EXPECT_EQ(answer.optimizer_step(), 1);
  EXPECT_NE(client_->GetWeights("cond", {"wi"})->at(0).tensor.bytes(),
            Find(*before, "wi")->bytes());
  ASSERT_TRUE(client_->DeleteLayer("cond").ok());
}

TEST_F(MoeClientTest, OneClientManyThreads) {
  ASSERT_TRUE(client_->CreateLayer("threads", TinyConfig()).ok());
  const Tensor x = RandomNormal(DType::kFloat32, {9, 32}, 11);
  auto reference = client_->Forward("threads", x);
  ASSERT_TRUE(reference.ok());
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) {
        auto out = client_->Forward("threads", x);
        if (!out.ok() || out->out.bytes() != reference->out.bytes()) ++mismatches[t];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
  ASSERT_TRUE(client_->DeleteLayer("threads").ok());
}

TEST(MoeClientConnectTest, RejectsBadArgumentsAndReportsUnavailable) {
  EXPECT_EQ(MoeClient::Connect("").status().code(), absl::StatusCode::kInvalidArgument);
  ClientOptions options;
  options.default_deadline = absl::ZeroDuration();
  EXPECT_EQ(MoeClient::Connect("localhost:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto client = MoeClient::Connect("127.0.0.1:1");  // nothing listens on port 1
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->Health().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*client)->ListLayers().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace client
}  // namespace moe

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s MOED MOE_WORKER\n", argv[0]);
    return 2;
  }
  moe::client::g_moed = argv[1];
  moe::client::g_worker = argv[2];
  return RUN_ALL_TESTS();
}
