// moed + 2 real moe-worker processes: the service's contract around the numbers: request
// validation codes, saved-step budget, layer lifecycle and expert-bias updates, reflection,
// fuzzed payloads, concurrent clients on two layers.
#include <grpcpp/generic/generic_stub.h>
#include <sys/time.h>

#include <atomic>
#include <random>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster_fixture.h"
#include "tests/server/metrics_scrape.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

TEST_F(ClusterTest, BadRequestsGetTheirCodes) {
  ASSERT_TRUE(Create("valid", TinyConfig(1)).ok());
  EXPECT_EQ(Create("valid", TinyConfig(1)).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  v1::LayerConfig bad = TinyConfig(1);
  bad.set_top_k(9);
  grpc::Status s = Create("bad", bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("top_k"));
  bad = TinyConfig(1);
  bad.set_ffn(kMaxFfn);  // valid, but ~3.2 GB of state: past this moed's --max_layer_bytes
  s = Create("huge", bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_layer_bytes"));
  bad = TinyConfig(1);
  bad.set_num_experts(7);  // not a multiple of 2 workers
  EXPECT_EQ(Create("bad", bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Create("bad/name", TinyConfig(1)).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::ForwardResponse fwd;
  v1::Tensor x = FloatsToProto({4, 32}, RandomFloats(128, 1));
  EXPECT_EQ(Forward("nope", x, false, &fwd).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::Tensor wrong = x;
  wrong.set_datatype("FP16");
  s = Forward("valid", wrong, false, &fwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("x.datatype"));
  wrong = x;
  wrong.set_datatype("INT32");
  EXPECT_THAT(Forward("valid", wrong, false, &fwd).error_message(), HasSubstr("x.datatype"));
  wrong = FloatsToProto({4, 16}, RandomFloats(64, 1));
  s = Forward("valid", wrong, false, &fwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("x.shape[1]"));
  wrong = x;
  wrong.mutable_raw_data()->pop_back();
  s = Forward("valid", wrong, false, &fwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("x"));
  wrong = FloatsToProto({2, 2, 32}, RandomFloats(128, 1));
  EXPECT_THAT(Forward("valid", wrong, false, &fwd).error_message(), HasSubstr("x.shape"));

  // Step ids: never issued, used, released, of another layer, wrong d_out.
  v1::BackwardResponse bwd;
  EXPECT_EQ(Backward("valid", uint64_t{1} << 40, x, &bwd).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(Forward("valid", x, true, &fwd).ok());
  const uint64_t step = fwd.step_id();
  s = Backward("valid", step, FloatsToProto({3, 32}, RandomFloats(96, 2)), &bwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("d_out.shape[0]"));
  ASSERT_TRUE(Create("other", TinyConfig(2)).ok());
  EXPECT_EQ(Backward("other", step, x, &bwd).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(Backward("valid", step, x, &bwd).ok());  // the bad requests did not consume it
  s = Backward("valid", step, x, &bwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("step_id"));
  ASSERT_TRUE(Forward("valid", x, true, &fwd).ok());
  {
    grpc::ClientContext ctx;
    v1::ReleaseStepRequest request;
    request.set_layer("valid");
    request.set_step_id(fwd.step_id());
    v1::ReleaseStepResponse response;
    ASSERT_TRUE(stub()->ReleaseStep(&ctx, request, &response).ok());
    EXPECT_TRUE(response.released());
  }
  EXPECT_EQ(Backward("valid", fwd.step_id(), x, &bwd).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // Optimizer and bias validation.
  {
    grpc::ClientContext ctx;
    v1::ApplyOptimizerRequest request;
    request.set_layer("valid");
    v1::ApplyOptimizerResponse response;
    s = stub()->ApplyOptimizer(&ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("optimizer"));
  }
  {
    grpc::ClientContext ctx;
    v1::UpdateExpertBiasRequest request;
    request.set_layer("valid");
    request.set_rate(0.1);
    v1::UpdateExpertBiasResponse response;
    EXPECT_EQ(stub()->UpdateExpertBias(&ctx, request, &response).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }

  // A name asked for twice is the request's error (it was INTERNAL: the gathered shards
  // repeated a tensor).
  for (bool gradients : {false, true}) {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::TensorChunk>> reader;
    if (gradients) {
      v1::GetGradientsRequest request;
      request.set_layer("valid");
      request.add_names("gate");
      request.add_names("gate");
      reader = stub()->GetGradients(&ctx, request);
    } else {
      v1::GetWeightsRequest request;
      request.set_layer("valid");
      request.add_names("wi");
      request.add_names("wo");
      request.add_names("wi");
      reader = stub()->GetWeights(&ctx, request);
    }
    v1::TensorChunk chunk;
    while (reader->Read(&chunk)) {
    }
    s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("names"));
  }

  // Checkpoint names that are not a relative path inside the checkpoint root are the
  // client's error, found before any worker writes.
  for (const char* dir : {"", "/", "//", "/tmp/x", "x/..", "x/../", "x/.", "../x", "a//b",
                          ".hidden", "it's", "a/.staging/b", "a\\b", "x\n"}) {
    grpc::ClientContext ctx;
    v1::SaveCheckpointRequest request;
    request.set_layer("valid");
    request.set_directory(dir);
    v1::SaveCheckpointResponse response;
    s = stub()->SaveCheckpoint(&ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << dir << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("directory")) << dir;
  }
}

TEST_F(ClusterTest, SavedStepBudget) {
  ASSERT_TRUE(Create("budget", TinyConfig(3)).ok());
  v1::Tensor x = FloatsToProto({8, 32}, RandomFloats(256, 3));
  std::vector<uint64_t> steps;
  for (int i = 0; i < 3; ++i) {
    v1::ForwardResponse fwd;
    ASSERT_TRUE(Forward("budget", x, true, &fwd).ok());
    steps.push_back(fwd.step_id());
  }
  v1::ForwardResponse fwd;
  grpc::Status s = Forward("budget", x, true, &fwd);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_saved_steps"));
  EXPECT_TRUE(Forward("budget", x, false, &fwd).ok());  // inference needs no budget
  v1::BackwardResponse bwd;
  ASSERT_TRUE(Backward("budget", steps[0], x, &bwd).ok());
  EXPECT_TRUE(Forward("budget", x, true, &fwd).ok());
  grpc::ClientContext ctx;
  v1::GetLayerRequest request;
  request.set_name("budget");
  v1::GetLayerResponse layer;
  ASSERT_TRUE(stub()->GetLayer(&ctx, request, &layer).ok());
  EXPECT_EQ(layer.layer().saved_steps(), 3);
  EXPECT_GT(layer.layer().saved_bytes(), 0);
}

// LayerInfo.fp8_gemms: the set the workers resolved (AUTO on CPU workers: fc1 in FP8 and
// fc2, whose F is 8, in bf16: engine/fp8_gemms.h CpuFp8GemmPays); empty for BF16.
TEST_F(ClusterTest, LayerInfoReportsTheFp8GemmsThatRun) {
  auto fp8_gemms = [&](const std::string& name) {
    grpc::ClientContext ctx;
    v1::GetLayerRequest request;
    request.set_name(name);
    v1::GetLayerResponse layer;
    EXPECT_TRUE(stub()->GetLayer(&ctx, request, &layer).ok());
    return layer.layer().fp8_gemms();
  };
  v1::LayerConfig config = TinyConfig(7);
  config.set_ffn(8);
  config.set_compute_dtype("FP8");
  ASSERT_TRUE(Create("fp8_auto", config).ok());
  EXPECT_EQ(fp8_gemms("fp8_auto"), "fc1_fprop,fc1_dgrad,fc1_wgrad");
  config.set_fp8_gemms("fc2_wgrad");
  ASSERT_TRUE(Create("fp8_set", config).ok());
  EXPECT_EQ(fp8_gemms("fp8_set"), "fc2_wgrad");
  config.set_fp8_gemms("");
  config.set_compute_dtype("BF16");
  ASSERT_TRUE(Create("bf16", config).ok());
  EXPECT_EQ(fp8_gemms("bf16"), "");
}

TEST_F(ClusterTest, LayerLifecycleAndExpertBias) {
  v1::LayerConfig config = TinyConfig(5);
  config.set_score_function(v1::SCORE_FUNCTION_SIGMOID);
  config.set_use_expert_bias(true);
  config.set_aux_loss_coeff(0);
  ASSERT_TRUE(Create("bias", config).ok());
  auto local = MakeLocalLayer(config);
  ASSERT_NE(local, nullptr);
  // Two forwards accumulate counts; the bias update matches the engine's.
  for (int i = 0; i < 2; ++i) {
    const std::vector<float> x = RandomFloats(24 * 32, 50 + i);
    v1::ForwardResponse fwd;
    ASSERT_TRUE(Forward("bias", FloatsToProto({24, 32}, x), false, &fwd).ok());
    ASSERT_TRUE(local->layer->Forward(Tensor::FromFloats({24, 32}, x), nullptr).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::GetLayerRequest request;
    request.set_name("bias");
    v1::GetLayerResponse layer;
    ASSERT_TRUE(stub()->GetLayer(&ctx, request, &layer).ok());
    EXPECT_EQ(layer.layer().forward_count(), 2);
    EXPECT_THAT(layer.layer().accumulated_load().tokens_per_expert(),
                ::testing::ElementsAreArray(local->layer->accumulated_expert_counts()));
    ASSERT_EQ(layer.layer().parameters_size(), 4);  // gate, expert_bias, wi, wo
    EXPECT_EQ(layer.layer().parameters(1).name(), "expert_bias");
    EXPECT_EQ(layer.layer().config().top_k(), 2);
  }
  {
    grpc::ClientContext ctx;
    v1::UpdateExpertBiasRequest request;
    request.set_layer("bias");
    request.set_rate(0.01);
    v1::UpdateExpertBiasResponse response;
    ASSERT_TRUE(stub()->UpdateExpertBias(&ctx, request, &response).ok());
    ASSERT_TRUE(local->layer->UpdateExpertBias(0.01).ok());
    auto ref = local->layer->GetParameter("expert_bias");
    ASSERT_TRUE(ref.ok());
    EXPECT_THAT(response.expert_bias(), ::testing::ElementsAreArray(TensorFloats(*ref)));
  }
  // Gradient names are checked; expert_bias has no gradient.
  {
    grpc::ClientContext ctx;
    v1::GetGradientsRequest request;
    request.set_layer("bias");
    request.add_names("expert_bias");
    auto reader = stub()->GetGradients(&ctx, request);
    v1::TensorChunk chunk;
    while (reader->Read(&chunk)) {
    }
    grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("names"));
  }
  // Delete: gone from the list, its name free again.
  {
    grpc::ClientContext ctx;
    v1::DeleteLayerRequest request;
    request.set_name("bias");
    v1::DeleteLayerResponse response;
    ASSERT_TRUE(stub()->DeleteLayer(&ctx, request, &response).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::ListLayersResponse layers;
    ASSERT_TRUE(stub()->ListLayers(&ctx, v1::ListLayersRequest(), &layers).ok());
    for (const auto& layer : layers.layers()) EXPECT_NE(layer.name(), "bias");
  }
  v1::ForwardResponse fwd;
  EXPECT_EQ(Forward("bias", FloatsToProto({1, 32}, RandomFloats(32, 1)), false, &fwd).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(Create("bias", TinyConfig(6)).ok());
}

// Server reflection lists the public service (what grpcurl / grpc_cli rely on).
TEST_F(ClusterTest, ReflectionListsTheService) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          cluster_->channel().get(), method, &ctx));
  // ServerReflectionRequest{list_services = ""}: field 7, length-delimited, empty.
  grpc::Slice slice(std::string("\x3a\x00", 2));
  grpc::ByteBuffer request(&slice, 1), response;
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  ASSERT_TRUE(stream->Read(&response));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  EXPECT_THAT(bytes, HasSubstr("moe.v1.MoeService"));
  EXPECT_THAT(bytes, HasSubstr("grpc.health.v1.Health"));
  while (stream->Read(&response)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ClusterTest, FuzzedPayloadsLeaveTheServerUp) {
  ASSERT_TRUE(Create("fuzz", TinyConfig(9)).ok());
  v1::ForwardRequest valid;
  valid.set_layer("fuzz");
  *valid.mutable_x() = FloatsToProto({6, 32}, RandomFloats(6 * 32, 9));
  valid.set_keep_for_backward(true);
  v1::BackwardRequest backward;
  backward.set_layer("fuzz");
  backward.set_step_id(1);
  *backward.mutable_d_out() = valid.x();
  v1::CreateLayerRequest create;
  create.set_name("fuzz2");
  *create.mutable_config() = TinyConfig(3);
  const std::vector<std::pair<std::string, std::string>> seeds = {
      {"/moe.v1.MoeService/Forward", valid.SerializeAsString()},
      {"/moe.v1.MoeService/Backward", backward.SerializeAsString()},
      {"/moe.v1.MoeService/CreateLayer", create.SerializeAsString()},
      {"/moe.v1.MoeService/ReleaseStep", backward.SerializeAsString()}};
  grpc::GenericStub generic(cluster_->channel());
  std::mt19937 gen(1234);
  int answered = 0;
  for (int i = 0; i < 300; ++i) {
    const auto& seed = seeds[i % seeds.size()];
    std::string payload = seed.second;
    switch (i % 3) {
      case 0:  // truncated
        payload.resize(gen() % (payload.size() + 1));
        break;
      case 1:  // bytes flipped
        for (int j = 0; j < 4 && !payload.empty(); ++j) payload[gen() % payload.size()] ^= gen();
        break;
      default:  // random bytes
        payload.resize(gen() % 64);
        for (char& c : payload) c = static_cast<char>(gen());
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Slice slice(payload);
    grpc::ByteBuffer request(&slice, 1), response;
    absl::Notification done;
    grpc::Status status;
    generic.UnaryCall(&ctx, seed.first, grpc::StubOptions(), &request, &response,
                      [&](grpc::Status s) {
                        status = s;
                        done.Notify();
                      });
    done.WaitForNotification();
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNAVAILABLE) << i << status.error_message();
    EXPECT_NE(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << i;
    ++answered;
  }
  EXPECT_EQ(answered, 300);
  EXPECT_TRUE(cluster_->MoedRunning());
  EXPECT_EQ(*cluster_->Health(), "SERVING");
  auto local = MakeLocalLayer(TinyConfig(9));
  v1::ForwardResponse fwd;
  ASSERT_TRUE(Forward("fuzz", valid.x(), false, &fwd).ok());
  auto ref = local->layer->Forward(Tensor::FromFloats({6, 32}, RandomFloats(6 * 32, 9)), nullptr);
  ASSERT_TRUE(ref.ok());
  EXPECT_LT(MaxRelError(ProtoToFloats(fwd.out()), TensorFloats(ref->out)), 1e-5);
}

TEST_F(ClusterTest, ConcurrentClientsOnTwoLayers) {
  const v1::LayerConfig config_a = TinyConfig(21), config_b = TinyConfig(22);
  ASSERT_TRUE(Create("conc_a", config_a).ok());
  ASSERT_TRUE(Create("conc_b", config_b).ok());
  auto local_a = MakeLocalLayer(config_a);
  auto local_b = MakeLocalLayer(config_b);
  constexpr int kThreads = 8, kSteps = 12;
  // Inference outputs do not depend on order: precompute them with the local engine.
  std::vector<std::vector<float>> inputs, expected;
  for (int i = 0; i < kThreads * kSteps; ++i) {
    const int64_t tokens = 1 + i % 17;
    inputs.push_back(RandomFloats(tokens * 32, 1000 + i));
    auto& local = (i % 2 == 0) ? local_a : local_b;
    auto ref = local->layer->Forward(Tensor::FromFloats({tokens, 32}, inputs.back()), nullptr);
    ASSERT_TRUE(ref.ok());
    expected.push_back(TensorFloats(ref->out));
  }
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int s = 0; s < kSteps; ++s) {
        const int i = t * kSteps + s;
        const int64_t tokens = 1 + i % 17;
        const std::string layer = (i % 2 == 0) ? "conc_a" : "conc_b";
        v1::ForwardResponse fwd;
        // Two threads keep activations on every third step and release them (so at most
        // two steps are held at once, within --max_saved_steps=3): steps interleave.
        const bool keep = t < 2 && s % 3 == 0;
        grpc::Status status = Forward(layer, FloatsToProto({tokens, 32}, inputs[i]), keep, &fwd);
        if (!status.ok()) {
          ADD_FAILURE() << status.error_code() << " " << status.error_message();
          ++failed;
          continue;
        }
        if (MaxRelError(ProtoToFloats(fwd.out()), expected[i]) > 1e-5) ++wrong;
        if (keep) {
          grpc::ClientContext ctx;
          v1::ReleaseStepRequest request;
          request.set_layer(layer);
          request.set_step_id(fwd.step_id());
          v1::ReleaseStepResponse response;
          if (!stub()->ReleaseStep(&ctx, request, &response).ok() || !response.released()) {
            ++failed;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed, 0);
  EXPECT_EQ(wrong, 0);
}

// A SetWeights stream is validated against the layer it named; if that layer is deleted and a
// layer of the same name with another config is created before the stream ends, the weights
// must not be applied to (or looked up in) the new layer. moed used to look the validated
// tensor names up in the new layer's parameters and died of std::out_of_range.
TEST_F(ClusterTest, SetWeightsDoesNotFollowARecreatedName) {
  v1::LayerConfig with_bias = TinyConfig(7);
  with_bias.set_use_bias(true);
  ASSERT_TRUE(Create("swap", with_bias).ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::SetWeightsResponse response;
  auto writer = stub()->SetWeights(&ctx, &response);
  v1::SetWeightsRequest message;
  message.set_layer("swap");
  v1::TensorChunk* chunk = message.mutable_chunk();
  chunk->set_name("wi_bias");  // [E, up] = [8, 128]: only the first layer has it
  chunk->set_datatype("FP32");
  chunk->add_shape(8);
  chunk->add_shape(128);
  chunk->set_raw_data(std::string(8 * 128 * sizeof(float), '\0'));
  ASSERT_TRUE(writer->Write(message));
  absl::SleepFor(absl::Milliseconds(300));  // moed has read and validated the chunk
  {
    grpc::ClientContext del_ctx;
    v1::DeleteLayerRequest request;
    request.set_name("swap");
    v1::DeleteLayerResponse deleted;
    ASSERT_TRUE(stub()->DeleteLayer(&del_ctx, request, &deleted).ok());
  }
  ASSERT_TRUE(Create("swap", TinyConfig(7)).ok());  // no bias terms
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  // moed is still up and the new layer untouched.
  grpc::ClientContext get_ctx;
  v1::GetLayerRequest get;
  get.set_name("swap");
  v1::GetLayerResponse layer;
  ASSERT_TRUE(stub()->GetLayer(&get_ctx, get, &layer).ok());
  EXPECT_FALSE(layer.layer().config().use_bias());
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// A deleted layer's series leave /metrics, and a layer created again under the same name
// counts from zero.
TEST_F(ClusterTest, DeleteLayerDropsItsMetrics) {
  const v1::LayerConfig config = TinyConfig(/*seed=*/21);
  ASSERT_TRUE(Create("metrics_drop", config).ok());
  v1::ForwardResponse fwd;
  ASSERT_TRUE(
      Forward("metrics_drop", FloatsToProto({5, 32}, RandomFloats(5 * 32, 1)), false, &fwd).ok());
  std::string reply = ScrapeMetrics(metrics_port_);
  EXPECT_THAT(reply, HasSubstr("moed_tokens_total{layer=\"metrics_drop\"} 5\n"));
  EXPECT_THAT(reply, HasSubstr("moed_expert_tokens_total{expert=\"0\",layer=\"metrics_drop\"}"));
  {
    grpc::ClientContext ctx;
    v1::DeleteLayerRequest request;
    request.set_name("metrics_drop");
    v1::DeleteLayerResponse response;
    ASSERT_TRUE(stub()->DeleteLayer(&ctx, request, &response).ok());
  }
  reply = ScrapeMetrics(metrics_port_);
  ASSERT_THAT(reply, HasSubstr("200 OK"));
  EXPECT_THAT(reply, ::testing::Not(HasSubstr("layer=\"metrics_drop\"")));
  ASSERT_TRUE(Create("metrics_drop", config).ok());
  ASSERT_TRUE(
      Forward("metrics_drop", FloatsToProto({3, 32}, RandomFloats(3 * 32, 2)), false, &fwd).ok());
  reply = ScrapeMetrics(metrics_port_);
  EXPECT_THAT(reply, HasSubstr("moed_tokens_total{layer=\"metrics_drop\"} 3\n"));
}

// issue 18: a forward and backward move the request histograms, moed's phase histograms and the
// payload bytes by exactly their amounts; a refused request is counted under its code.
TEST_F(ClusterTest, HistogramsAndErrorCountersMoveByTheStep) {
  ASSERT_TRUE(Create("metrics_step", TinyConfig(/*seed=*/22)).ok());
  const std::string before = ScrapeMetrics(metrics_port_);
  ASSERT_THAT(before, HasSubstr("200 OK"));
  v1::ForwardResponse fwd;
  ASSERT_TRUE(
      Forward("metrics_step", FloatsToProto({6, 32}, RandomFloats(6 * 32, 3)), true, &fwd).ok());
  {
    grpc::ClientContext ctx;
    v1::BackwardRequest request;
    request.set_layer("metrics_step");
    request.set_step_id(fwd.step_id());
    *request.mutable_d_out() = FloatsToProto({6, 32}, RandomFloats(6 * 32, 4));
    v1::BackwardResponse response;
    ASSERT_TRUE(stub()->Backward(&ctx, request, &response).ok());
  }
  v1::ForwardResponse refused;  // 5 columns for a hidden size of 32: INVALID_ARGUMENT (3)
  EXPECT_FALSE(
      Forward("metrics_step", FloatsToProto({2, 5}, RandomFloats(10, 5)), false, &refused).ok());
  const std::string after = ScrapeMetrics(metrics_port_);
  auto delta = [&](const std::string& series) {
    return Sample(after, series) - Sample(before, series);
  };
  EXPECT_EQ(delta("moed_request_duration_seconds_count{method=\"Backward\"}"), 1);
  EXPECT_EQ(delta("moed_request_duration_seconds_count{method=\"Forward\"}"), 2);
  EXPECT_GT(delta("moed_request_duration_seconds_sum{method=\"Backward\"}"), 0);
  EXPECT_EQ(delta("moed_requests_total{code=\"3\",method=\"Forward\"}"), 1);
  EXPECT_EQ(delta("moed_requests_total{code=\"0\",method=\"Forward\"}"), 1);
  for (const char* call : {"Forward", "Backward"}) {
    for (const char* phase : {"queue", "workers", "gather"}) {
      const std::string series = absl::StrCat("moed_step_phase_seconds_count{call=\"", call,
                                              "\",layer=\"metrics_step\",phase=\"", phase, "\"}");
      EXPECT_EQ(Sample(after, series), 1) << series;
    }
  }
  for (const char* phase : {"call", "handler", "decode", "engine", "encode"}) {
    for (int rank : {0, 1}) {
      const std::string series =
          absl::StrCat("moed_worker_phase_seconds_count{call=\"Backward\",phase=\"", phase,
                       "\",rank=\"", rank, "\"}");
      EXPECT_EQ(delta(series), 1) << series;
    }
  }
  EXPECT_GT(delta("moed_worker_phase_seconds_sum{call=\"Forward\",phase=\"engine\",rank=\"0\"}"),
            0);
  // The two workers' slices add up to the step's bytes (6 rows split between them).
  EXPECT_EQ(delta("moed_worker_payload_bytes_total{direction=\"in\",rank=\"0\"}") +
                delta("moed_worker_payload_bytes_total{direction=\"in\",rank=\"1\"}"),
            2 * 6 * 32 * 4);
  // 6 tokens x 32 fp32 in and out, each way.
  EXPECT_EQ(delta("moed_payload_bytes_total{call=\"Forward\",direction=\"in\"}"), 6 * 32 * 4);
  EXPECT_EQ(delta("moed_payload_bytes_total{call=\"Backward\",direction=\"out\"}"), 6 * 32 * 4);
  EXPECT_EQ(delta("moed_saved_steps_total{event=\"created\"}"), 1);
  EXPECT_EQ(delta("moed_saved_steps_total{event=\"used\"}"), 1);
  EXPECT_EQ(Sample(after, "moed_saved_steps{layer=\"metrics_step\"}"), 0);
  // Each worker's all-to-all of each step is one observation; what the workers sent each other
  // is what they received, and with experts on both ranks some tokens crossed.
  double sent = 0, received = 0;
  for (int rank : {0, 1}) {
    for (const char* call : {"Forward", "Backward"}) {
      const std::string series = absl::StrCat("moed_worker_all_to_all_seconds_count{call=\"", call,
                                              "\",rank=\"", rank, "\"}");
      EXPECT_EQ(delta(series), 1) << series;
    }
    sent += delta(
        absl::StrCat("moed_worker_all_to_all_bytes_total{direction=\"sent\",rank=\"", rank, "\"}"));
    received += delta(absl::StrCat(
        "moed_worker_all_to_all_bytes_total{direction=\"received\",rank=\"", rank, "\"}"));
  }
  EXPECT_GT(sent, 0);
  EXPECT_EQ(sent, received);
  // Every call above has been answered: nothing in flight, but the series exist.
  EXPECT_THAT(after, HasSubstr("moed_inflight_requests{method=\"Forward\"} 0\n"));
  EXPECT_THAT(after, HasSubstr("moed_inflight_requests{method=\"Backward\"} 0\n"));
  // Buckets are cumulative and end at +Inf with the count.
  EXPECT_THAT(after,
              HasSubstr("moed_request_duration_seconds_bucket{method=\"Backward\",le=\"+Inf\"}"));
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// --saved_step_ttl_s: a saved step left unused (its client died) is released, freeing the
// budget for others; a late Backward on it says it expired. A step used in time is unaffected.
TEST(SavedStepTtlTest, AbandonedStepsExpire) {
  ClusterOptions options;
  options.moed_flags = {"--saved_step_ttl_s=1", "--max_saved_steps=2"};
  auto started = TestCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<TestCluster> cluster = std::move(*started);
  ASSERT_TRUE(cluster->WaitServing(absl::Seconds(30)).ok());
  v1::MoeService::Stub* stub = cluster->stub();
  {
    grpc::ClientContext ctx;
    v1::CreateLayerRequest request;
    request.set_name("ttl");
    *request.mutable_config() = TinyConfig(/*seed=*/5);
    v1::CreateLayerResponse response;
    ASSERT_TRUE(stub->CreateLayer(&ctx, request, &response).ok());
  }
  const v1::Tensor x = FloatsToProto({4, 32}, RandomFloats(4 * 32, 5));
  auto forward = [&](uint64_t* step) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ForwardRequest request;
    request.set_layer("ttl");
    *request.mutable_x() = x;
    request.set_keep_for_backward(true);
    v1::ForwardResponse response;
    grpc::Status status = stub->Forward(&ctx, request, &response);
    *step = response.step_id();
    return status;
  };
  auto backward = [&](uint64_t step) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::BackwardRequest request;
    request.set_layer("ttl");
    request.set_step_id(step);
    *request.mutable_d_out() = x;
    v1::BackwardResponse response;
    return stub->Backward(&ctx, request, &response);
  };
  auto saved_steps = [&]() -> int64_t {
    grpc::ClientContext ctx;
    v1::GetLayerRequest request;
    request.set_name("ttl");
    v1::GetLayerResponse response;
    if (!stub->GetLayer(&ctx, request, &response).ok()) return -1;
    return response.layer().saved_steps();
  };
  // Used within the TTL: fine.
  uint64_t prompt = 0;
  ASSERT_TRUE(forward(&prompt).ok());
  grpc::Status status = backward(prompt);
  ASSERT_TRUE(status.ok()) << status.error_message();
  // Abandoned: the budget fills, then the steps expire and the budget is free again.
  uint64_t abandoned[2];
  ASSERT_TRUE(forward(&abandoned[0]).ok());
  ASSERT_TRUE(forward(&abandoned[1]).ok());
  uint64_t refused = 0;
  EXPECT_EQ(forward(&refused).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (saved_steps() != 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(saved_steps(), 0);
  status = backward(abandoned[0]);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("expired"));
  EXPECT_THAT(status.error_message(), HasSubstr("--saved_step_ttl_s"));
  uint64_t fresh = 0;
  ASSERT_TRUE(forward(&fresh).ok());
  status = backward(fresh);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// Without --allow_client_shm every shared-memory call, and a step naming a region, is
// UNIMPLEMENTED (shm_test covers the feature itself).
TEST_F(ClusterTest, SharedMemoryIsOffWithoutTheFlag) {
  grpc::ClientContext rctx;
  v1::RegisterSystemSharedMemoryRequest reg;
  reg.set_name("r");
  reg.set_key("/anything");
  reg.set_byte_size(16);
  v1::RegisterSystemSharedMemoryResponse reg_response;
  grpc::Status s = stub()->RegisterSystemSharedMemory(&rctx, reg, &reg_response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--allow_client_shm"));
  grpc::ClientContext sctx;
  v1::SystemSharedMemoryStatusResponse status;
  EXPECT_EQ(stub()->SystemSharedMemoryStatus(&sctx, {}, &status).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  grpc::ClientContext cctx;
  v1::RegisterCudaSharedMemoryRequest cuda;
  cuda.set_name("g");
  cuda.set_raw_handle(std::string(64, 'h'));
  cuda.set_byte_size(16);
  v1::RegisterCudaSharedMemoryResponse cuda_response;
  EXPECT_EQ(stub()->RegisterCudaSharedMemory(&cctx, cuda, &cuda_response).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  grpc::ClientContext uctx;
  v1::UnregisterSystemSharedMemoryResponse unreg;
  EXPECT_EQ(stub()->UnregisterSystemSharedMemory(&uctx, {}, &unreg).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  ASSERT_TRUE(Create("shm-off", TinyConfig(1)).ok());
  grpc::ClientContext fctx;
  v1::ForwardRequest fwd;
  fwd.set_layer("shm-off");
  fwd.mutable_x_shm()->set_region("r");
  v1::ForwardResponse fwd_response;
  EXPECT_EQ(stub()->Forward(&fctx, fwd, &fwd_response).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  grpc::ClientContext bctx;
  v1::BackwardRequest bwd;
  bwd.set_layer("shm-off");
  bwd.set_step_id(1);
  *bwd.mutable_d_out() = FloatsToProto({1, 32}, RandomFloats(32, 1));
  bwd.mutable_d_x_shm()->set_region("r");
  v1::BackwardResponse bwd_response;
  EXPECT_EQ(stub()->Backward(&bctx, bwd, &bwd_response).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

}  // namespace
}  // namespace moe
