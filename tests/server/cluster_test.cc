// moed + 2 real moe-worker processes on localhost: steps through the service equal the
// engine run in one process; bad requests get their codes; budgets; weights; checkpoints.
#include "tests/server/cluster.h"

#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <random>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

class ClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    metrics_port_ = FreePort();
    ClusterOptions options;
    options.workers = 2;
    // --max_layer_bytes: fuzzed configs must not make the workers allocate gigabytes.
    options.moed_flags = {"--max_saved_steps=3", "--max_layer_bytes=268435456",
                          absl::StrCat("--metrics_port=", metrics_port_)};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  v1::MoeService::Stub* stub() { return cluster_->stub(); }

  grpc::Status Create(const std::string& name, const v1::LayerConfig& config) {
    grpc::ClientContext ctx;
    v1::CreateLayerRequest request;
    request.set_name(name);
    *request.mutable_config() = config;
    v1::CreateLayerResponse response;
    return stub()->CreateLayer(&ctx, request, &response);
  }
  grpc::Status Forward(const std::string& layer, const v1::Tensor& x, bool keep,
                       v1::ForwardResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ForwardRequest request;
    request.set_layer(layer);
    *request.mutable_x() = x;
    request.set_keep_for_backward(keep);
    return stub()->Forward(&ctx, request, response);
  }
  grpc::Status Backward(const std::string& layer, uint64_t step, const v1::Tensor& d_out,
                        v1::BackwardResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::BackwardRequest request;
    request.set_layer(layer);
    request.set_step_id(step);
    *request.mutable_d_out() = d_out;
    return stub()->Backward(&ctx, request, response);
  }
  std::map<std::string, std::vector<float>> Weights(const std::string& layer, bool gradients,
                                                    int64_t chunk_bytes = 0) {
    grpc::ClientContext ctx;
    grpc::Status status;
    std::map<std::string, std::vector<float>> out;
    if (gradients) {
      v1::GetGradientsRequest request;
      request.set_layer(layer);
      request.set_max_chunk_bytes(chunk_bytes);
      auto reader = stub()->GetGradients(&ctx, request);
      out = ReadChunks(reader.get(), &status);
    } else {
      v1::GetWeightsRequest request;
      request.set_layer(layer);
      request.set_max_chunk_bytes(chunk_bytes);
      auto reader = stub()->GetWeights(&ctx, request);
      out = ReadChunks(reader.get(), &status);
    }
    EXPECT_TRUE(status.ok()) << status.error_message();
    return out;
  }

  static TestCluster* cluster_;
  static int metrics_port_;
};
TestCluster* ClusterTest::cluster_ = nullptr;
int ClusterTest::metrics_port_ = 0;

TEST_F(ClusterTest, ForwardBackwardMatchLocalEngine) {
  const v1::LayerConfig config = TinyConfig(/*seed=*/7);
  ASSERT_TRUE(Create("match", config).ok());
  auto local = MakeLocalLayer(config);
  ASSERT_NE(local, nullptr);
  // Uneven splits, a worker with no tokens, and no tokens at all.
  for (int64_t tokens : {33, 32, 1, 0}) {
    SCOPED_TRACE(tokens);
    const std::vector<float> x = RandomFloats(tokens * 32, 100 + tokens);
    const std::vector<float> d_out = RandomFloats(tokens * 32, 200 + tokens);
    v1::ForwardResponse fwd;
    grpc::Status status = Forward("match", FloatsToProto({tokens, 32}, x), true, &fwd);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_NE(fwd.step_id(), 0u);

    std::unique_ptr<StepContext> saved;
    auto ref = local->layer->Forward(Tensor::FromFloats({tokens, 32}, x), &saved);
    ASSERT_TRUE(ref.ok()) << ref.status();
    EXPECT_LT(MaxRelError(ProtoToFloats(fwd.out()), TensorFloats(ref->out)), 1e-5);
    EXPECT_NEAR(fwd.aux_loss(), ref->aux_loss, 1e-6 * std::max(1.0, std::abs(ref->aux_loss)));
    EXPECT_NEAR(fwd.z_loss(), ref->z_loss, 1e-6 * std::max(1.0, std::abs(ref->z_loss)));
    EXPECT_THAT(fwd.tokens_per_expert(), ::testing::ElementsAreArray(ref->tokens_per_expert));
    int64_t total = 0;
    for (int64_t c : fwd.load().tokens_per_expert()) total += c;
    EXPECT_EQ(total, tokens * 2);

    v1::BackwardResponse bwd;
    status = Backward("match", fwd.step_id(), FloatsToProto({tokens, 32}, d_out), &bwd);
    ASSERT_TRUE(status.ok()) << status.error_message();
    auto ref_dx = local->layer->Backward(*saved, Tensor::FromFloats({tokens, 32}, d_out), 1.0, 1.0);
    ASSERT_TRUE(ref_dx.ok()) << ref_dx.status();
    EXPECT_LT(MaxRelError(ProtoToFloats(bwd.d_x()), TensorFloats(*ref_dx)), 1e-5);
  }
  // Accumulated gradients over the four steps.
  auto grads = Weights("match", /*gradients=*/true, /*chunk_bytes=*/4000);
  for (const char* name : {"gate", "wi", "wo"}) {
    auto ref = local->layer->GetGradient(name);
    ASSERT_TRUE(ref.ok());
    EXPECT_LT(MaxRelError(grads[name], TensorFloats(*ref)), 1e-5) << name;
  }
  // An optimizer step changes the weights as the engine's does.
  {
    grpc::ClientContext ctx;
    v1::ApplyOptimizerRequest request;
    request.set_layer("match");
    request.mutable_adamw()->set_lr(1e-2);
    request.mutable_adamw()->set_weight_decay(0.01);
    v1::ApplyOptimizerResponse response;
    ASSERT_TRUE(stub()->ApplyOptimizer(&ctx, request, &response).ok());
    ASSERT_TRUE(local->layer->ApplyOptimizer(OptimizerConfig::AdamW(1e-2, 0.01)).ok());
  }
  auto weights = Weights("match", /*gradients=*/false);
  for (const char* name : {"gate", "wi", "wo"}) {
    auto ref = local->layer->GetParameter(name);
    ASSERT_TRUE(ref.ok());
    EXPECT_LT(MaxRelError(weights[name], TensorFloats(*ref)), 1e-5) << name;
  }
}

TEST_F(ClusterTest, Bf16ActivationsAndCompute) {
  v1::LayerConfig config = TinyConfig(8);
  config.set_compute_dtype("BF16");
  ASSERT_TRUE(Create("bf16", config).ok());
  auto local = MakeLocalLayer(config);
  ASSERT_NE(local, nullptr);
  const int64_t tokens = 19;
  Tensor x =
      Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, 8)).ConvertTo(DType::kBFloat16);
  Tensor d_out =
      Tensor::FromFloats({tokens, 32}, RandomFloats(tokens * 32, 9)).ConvertTo(DType::kBFloat16);
  v1::Tensor x_proto, d_out_proto;
  TensorToProto(x, &x_proto);
  TensorToProto(d_out, &d_out_proto);
  v1::ForwardResponse fwd;
  ASSERT_TRUE(Forward("bf16", x_proto, true, &fwd).ok());
  EXPECT_EQ(fwd.out().datatype(), "BF16");
  EXPECT_EQ(fwd.out().raw_data().size(), static_cast<size_t>(tokens * 32 * 2));
  std::unique_ptr<StepContext> saved;
  auto ref = local->layer->Forward(x, &saved);
  ASSERT_TRUE(ref.ok());
  // bf16 outputs: EP=2 and EP=1 may round the fp32 accumulations one bf16 ulp apart.
  EXPECT_LT(MaxRelError(ProtoToFloats(fwd.out()), TensorFloats(ref->out)), 1e-2);
  v1::BackwardResponse bwd;
  ASSERT_TRUE(Backward("bf16", fwd.step_id(), d_out_proto, &bwd).ok());
  EXPECT_EQ(bwd.d_x().datatype(), "BF16");
  auto ref_dx = local->layer->Backward(*saved, d_out, 1.0, 1.0);
  ASSERT_TRUE(ref_dx.ok());
  EXPECT_LT(MaxRelError(ProtoToFloats(bwd.d_x()), TensorFloats(*ref_dx)), 1e-2);
}

TEST_F(ClusterTest, BadRequestsGetTheirCodes) {
  ASSERT_TRUE(Create("valid", TinyConfig(1)).ok());
  EXPECT_EQ(Create("valid", TinyConfig(1)).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  v1::LayerConfig bad = TinyConfig(1);
  bad.set_top_k(9);
  grpc::Status s = Create("bad", bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("top_k"));
  bad = TinyConfig(1);
  bad.set_ffn(int64_t{1} << 40);
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

TEST_F(ClusterTest, WeightsRoundTripAndCheckpoint) {
  ASSERT_TRUE(Create("weights", TinyConfig(4)).ok());
  auto before = Weights("weights", false, /*chunk_bytes=*/1000);
  ASSERT_EQ(before["wi"].size(), 8u * 32 * 128);
  // SetWeights: doubled wi, in small chunks.
  std::vector<float> doubled = before["wi"];
  for (float& v : doubled) v *= 2;
  {
    grpc::ClientContext ctx;
    v1::SetWeightsResponse response;
    auto writer = stub()->SetWeights(&ctx, &response);
    Tensor wi = Tensor::FromFloats({8, 32, 128}, doubled);
    bool first = true;
    ASSERT_TRUE(ChunkTensor("wi", wi, 5000, [&](const v1::TensorChunk& chunk) {
                  v1::SetWeightsRequest request;
                  if (first) request.set_layer("weights");
                  first = false;
                  *request.mutable_chunk() = chunk;
                  return writer->Write(request) ? absl::OkStatus() : absl::UnknownError("w");
                }).ok());
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_THAT(response.updated(), ::testing::ElementsAre("wi"));
  }
  auto after = Weights("weights", false);
  EXPECT_EQ(after["wi"], doubled);
  EXPECT_EQ(after["gate"], before["gate"]);
  // A stream with a wrong shape changes nothing.
  {
    grpc::ClientContext ctx;
    v1::SetWeightsResponse response;
    auto writer = stub()->SetWeights(&ctx, &response);
    v1::SetWeightsRequest request;
    request.set_layer("weights");
    request.mutable_chunk()->set_name("wo");
    request.mutable_chunk()->set_datatype("FP32");
    request.mutable_chunk()->add_shape(3);
    request.mutable_chunk()->set_raw_data(std::string(12, '\0'));
    writer->Write(request);
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("shape"));
  }
  EXPECT_EQ(Weights("weights", false)["wo"], before["wo"]);

  // Checkpoint, change, load back.
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/ckpt_weights");
  for (int round = 0; round < 2; ++round) {  // the second save replaces the first
    grpc::ClientContext ctx;
    v1::SaveCheckpointRequest request;
    request.set_layer("weights");
    request.set_directory(dir);
    v1::SaveCheckpointResponse response;
    grpc::Status s = stub()->SaveCheckpoint(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::SetWeightsResponse response;
    auto writer = stub()->SetWeights(&ctx, &response);
    Tensor wi = Tensor::FromFloats({8, 32, 128}, before["wi"]);
    ChunkTensor("wi", wi, 1 << 20, [&](const v1::TensorChunk& chunk) {
      v1::SetWeightsRequest request;
      request.set_layer("weights");
      *request.mutable_chunk() = chunk;
      writer->Write(request);
      return absl::OkStatus();
    }).IgnoreError();
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
  }
  EXPECT_EQ(Weights("weights", false)["wi"], before["wi"]);
  {
    grpc::ClientContext ctx;
    v1::LoadCheckpointRequest request;
    request.set_layer("weights");
    request.set_directory(dir);
    v1::LoadCheckpointResponse response;
    grpc::Status s = stub()->LoadCheckpoint(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(Weights("weights", false)["wi"], doubled);
  {
    grpc::ClientContext ctx;
    v1::LoadCheckpointRequest request;
    request.set_layer("weights");
    request.set_directory(dir + "_missing");
    v1::LoadCheckpointResponse response;
    EXPECT_EQ(stub()->LoadCheckpoint(&ctx, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

TEST_F(ClusterTest, StatusHealthAndMetrics) {
  EXPECT_EQ(*cluster_->Health(), "SERVING");
  grpc::ClientContext ctx;
  v1::GetStatusResponse status;
  ASSERT_TRUE(stub()->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
  EXPECT_TRUE(status.serving());
  EXPECT_EQ(status.world_size(), 2);
  ASSERT_EQ(status.workers_size(), 2);
  for (const auto& w : status.workers()) {
    EXPECT_TRUE(w.alive());
    EXPECT_EQ(w.device(), "cpu");
    EXPECT_FALSE(w.address().empty());
  }
  // Prometheus text over HTTP.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(metrics_port_);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string get = "GET /metrics HTTP/1.0\r\n\r\n";
  ASSERT_EQ(write(fd, get.data(), get.size()), static_cast<ssize_t>(get.size()));
  std::string reply;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) reply.append(buffer, n);
  close(fd);
  EXPECT_THAT(reply, HasSubstr("200 OK"));
  EXPECT_THAT(reply, HasSubstr("moed_serving 1"));
  EXPECT_THAT(reply, HasSubstr("moed_requests_total{method=\"GetStatus\""));
  EXPECT_THAT(reply, HasSubstr("moed_worker_alive{rank=\"1\"} 1"));
}

// Random, truncated and bit-flipped payloads: the server answers each with an error or a
// result and stays up; afterwards a valid step still matches.
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

}  // namespace
}  // namespace moe
