// moed + 2 real moe-worker processes on localhost: steps through the service equal the
// engine run in one process (fp32 and bf16), optimizer steps match, weights round-trip
// through GetWeights/SetWeights, checkpoints save and load, status/health/metrics.
#include <atomic>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster_fixture.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

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
  const std::string dir = "runs/ckpt_weights";  // inside moed's --checkpoint_root
  for (int round = 0; round < 2; ++round) {     // the second save replaces the first
    grpc::ClientContext ctx;
    v1::SaveCheckpointRequest request;
    request.set_layer("weights");
    request.set_directory(dir);
    v1::SaveCheckpointResponse response;
    grpc::Status s = stub()->SaveCheckpoint(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.directory(), dir);
  }
  // The replaced checkpoint and the staging are gone: the root holds the checkpoint and
  // this moed's (empty) staging folder only.
  const std::string root = cluster_->checkpoint_root();
  for (const auto& entry : std::filesystem::directory_iterator(root + "/runs")) {
    EXPECT_EQ(entry.path().filename().string(), "ckpt_weights") << "left behind";
  }
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root + "/.staging")) {
    EXPECT_FALSE(entry.is_directory() && entry.path().parent_path().filename() != ".staging")
        << "left behind: " << entry.path();
  }
  EXPECT_TRUE(std::filesystem::exists(root + "/runs/ckpt_weights/MOED_CHECKPOINT"));
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
  EXPECT_THAT(reply, HasSubstr("method=\"GetStatus\"}"));
  EXPECT_THAT(reply, HasSubstr("moed_worker_alive{rank=\"1\"} 1"));
}

// A client that trickles its request head must not hold every other scrape (prometheus-cpp's
// exposer serves from two threads) nor moed's shutdown.
TEST_F(ClusterTest, SlowMetricsClientDoesNotBlockScrapes) {
  auto connect_metrics = [&] {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(metrics_port_);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  };
  std::atomic<bool> done{false};
  const int slow = connect_metrics();
  std::thread trickle([&] {
    for (int i = 0; i < 40 && !done; ++i) {  // one byte every 150 ms for up to 6 s
      if (write(slow, "G", 1) != 1) break;
      absl::SleepFor(absl::Milliseconds(150));
    }
  });
  absl::SleepFor(absl::Milliseconds(300));
  const int fd = connect_metrics();
  timeval timeout{4, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  const std::string get = "GET /metrics HTTP/1.0\r\n\r\n";
  ASSERT_EQ(write(fd, get.data(), get.size()), static_cast<ssize_t>(get.size()));
  std::string reply;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) reply.append(buffer, n);
  close(fd);
  done = true;
  trickle.join();
  close(slow);
  EXPECT_THAT(reply, HasSubstr("200 OK"));
}

// Workers report their backend memory (parameters, optimizer state, kept steps) through the
// heartbeat: > 0 with a layer, more with a kept step, back down when it is released.
TEST_F(ClusterTest, WorkerMemoryTelemetry) {
  // (now, peak) per rank, from heartbeats answered after `after` (plus a margin for the ping's
  // own latency), so that the numbers include every call that returned before `after`.
  auto memory_after = [&](absl::Time after) {
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (true) {
      const absl::Time asked = absl::Now();
      grpc::ClientContext ctx;
      v1::GetStatusResponse status;
      EXPECT_TRUE(stub()->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
      std::vector<std::pair<int64_t, int64_t>> memory;
      bool fresh = status.workers_size() == 2;
      for (const auto& w : status.workers()) {
        // A lower bound of when the worker's last answer arrived.
        const absl::Time seen = asked - absl::Milliseconds(w.last_seen_ms_ago() + 1);
        fresh = fresh && w.last_seen_ms_ago() >= 0 && seen >= after + absl::Milliseconds(50);
        memory.emplace_back(w.memory_bytes(), w.peak_memory_bytes());
      }
      if (fresh) return memory;
      if (absl::Now() > give_up) {
        ADD_FAILURE() << "no fresh heartbeat";
        return memory;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  };

  const auto before = memory_after(absl::Now());
  ASSERT_TRUE(Create("memory", TinyConfig(/*seed=*/21)).ok());
  const auto with_layer = memory_after(absl::Now());
  ASSERT_EQ(before.size(), 2u);
  ASSERT_EQ(with_layer.size(), 2u);
  for (size_t r = 0; r < with_layer.size(); ++r) {
    EXPECT_GT(with_layer[r].first, 0) << "rank " << r;
    EXPECT_GT(with_layer[r].first, before[r].first) << "rank " << r;  // the layer's parameters
    EXPECT_GE(with_layer[r].second, with_layer[r].first) << "rank " << r;
  }

  // 256 tokens, 128 per worker: x fp32 alone is 16 KiB of kept memory on each.
  v1::ForwardResponse fwd;
  ASSERT_TRUE(Forward("memory", FloatsToProto({256, 32}, RandomFloats(256 * 32, 5)),
                      /*keep=*/true, &fwd)
                  .ok());
  ASSERT_NE(fwd.step_id(), 0u);
  const auto with_step = memory_after(absl::Now());
  ASSERT_EQ(with_step.size(), 2u);
  for (size_t r = 0; r < with_step.size(); ++r) {
    EXPECT_GE(with_step[r].first, with_layer[r].first + 256 / 2 * 32 * 4) << "rank " << r;
    EXPECT_GE(with_step[r].second, with_step[r].first) << "rank " << r;
  }

  {
    grpc::ClientContext ctx;
    v1::ReleaseStepRequest request;
    request.set_layer("memory");
    request.set_step_id(fwd.step_id());
    v1::ReleaseStepResponse response;
    ASSERT_TRUE(stub()->ReleaseStep(&ctx, request, &response).ok());
  }
  const auto released = memory_after(absl::Now());
  ASSERT_EQ(released.size(), 2u);
  for (size_t r = 0; r < released.size(); ++r) {
    EXPECT_LT(released[r].first, with_step[r].first) << "rank " << r;
    EXPECT_GE(released[r].second, with_step[r].first) << "rank " << r;  // the peak stays
  }
  grpc::ClientContext ctx;
  v1::DeleteLayerRequest request;
  request.set_name("memory");
  v1::DeleteLayerResponse response;
  EXPECT_TRUE(stub()->DeleteLayer(&ctx, request, &response).ok());
}

// Random, truncated and bit-flipped payloads: the server answers each with an error or a
// result and stays up; afterwards a valid step still matches.
}  // namespace
}  // namespace moe
