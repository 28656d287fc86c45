// moed + 2 real moe-worker processes with one large layer: what open weight streams may hold
// in moed (--max_stream_bytes) and how busy handler threads refuse calls (--handler_threads).
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

// A cluster with one large layer "big" (wi [8, 128, 8192]: 32 MiB; wo [8, 4096, 128]: 16 MiB)
// and a client channel without BDP probing: its receive window stays small, so moed cannot
// finish writing 32 MiB to a reader that does not read, and the stream stays open.
class BigLayerTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> moed_flags) {
    ClusterOptions options;
    options.moed_flags = std::move(moed_flags);
    auto started = TestCluster::Start(options);
    ASSERT_TRUE(started.ok()) << started.status();
    cluster_ = std::move(*started);
    ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetMaxReceiveMessageSize(-1);
    stub_ = v1::MoeService::NewStub(
        grpc::CreateCustomChannel(cluster_->address(), grpc::InsecureChannelCredentials(), args));
    v1::LayerConfig config = TinyConfig(/*seed=*/8);
    config.set_hidden(128);
    config.set_ffn(4096);
    grpc::ClientContext ctx;
    v1::CreateLayerRequest request;
    request.set_name("big");
    *request.mutable_config() = config;
    v1::CreateLayerResponse response;
    grpc::Status s = stub_->CreateLayer(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  std::unique_ptr<grpc::ClientReader<v1::TensorChunk>> Open(grpc::ClientContext* ctx,
                                                            std::vector<std::string> names) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::GetWeightsRequest request;
    request.set_layer("big");
    for (const std::string& n : names) request.add_names(n);
    request.set_max_chunk_bytes(65536);
    return stub_->GetWeights(ctx, request);
  }
  // Reads a whole stream: its status, and the bytes it carried added to *bytes.
  static grpc::Status Drain(grpc::ClientReader<v1::TensorChunk>* reader, int64_t* bytes) {
    v1::TensorChunk chunk;
    while (reader->Read(&chunk)) *bytes += static_cast<int64_t>(chunk.raw_data().size());
    return reader->Finish();
  }
  // SetWeights of the named tensors (each filled with `value`), 1 MiB chunks.
  grpc::Status SetWeights(const std::map<std::string, std::vector<int64_t>>& shapes, float value) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::SetWeightsResponse response;
    auto writer = stub_->SetWeights(&ctx, &response);
    for (const auto& [name, shape] : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      Tensor tensor = Tensor::FromFloats(shape, std::vector<float>(n, value));
      absl::Status sent = ChunkTensor(name, tensor, 1 << 20, [&](const v1::TensorChunk& chunk) {
        v1::SetWeightsRequest request;
        request.set_layer("big");
        *request.mutable_chunk() = chunk;
        return writer->Write(request) ? absl::OkStatus() : absl::CancelledError("closed");
      });
      if (!sent.ok()) break;  // moed answered early; Finish has its status
    }
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status Forward() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ForwardRequest request;
    request.set_layer("big");
    *request.mutable_x() = FloatsToProto({4, 128}, RandomFloats(4 * 128, 3));
    v1::ForwardResponse response;
    return stub_->Forward(&ctx, request, &response);
  }

  static constexpr int64_t kWiBytes = int64_t{8} * 128 * 8192 * 4;
  static constexpr int64_t kAllBytes = kWiBytes + int64_t{8} * 4096 * 128 * 4 + 128 * 8 * 4;
  std::unique_ptr<TestCluster> cluster_;
  std::unique_ptr<v1::MoeService::Stub> stub_;
};

// --max_stream_bytes: a reader that stops after one chunk keeps its 32 MiB gathered copy in
// moed; a second large stream is RESOURCE_EXHAUSTED while a small one still fits; once the
// first stream ends, its bytes are free again.
TEST_F(BigLayerTest, OpenStreamsShareABudget) {
  Start({"--max_stream_bytes=67108864"});  // 64 MiB
  grpc::ClientContext first_ctx;
  auto first = Open(&first_ctx, {"wi"});
  v1::TensorChunk chunk;
  ASSERT_TRUE(first->Read(&chunk));  // moed has gathered wi and holds it
  int64_t first_bytes = static_cast<int64_t>(chunk.raw_data().size());
  {
    grpc::ClientContext ctx;
    auto second = Open(&ctx, {});  // every parameter: 48 MiB more
    int64_t bytes = 0;
    grpc::Status s = Drain(second.get(), &bytes);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("--max_stream_bytes=67108864"));
    EXPECT_EQ(bytes, 0);
  }
  {
    grpc::ClientContext ctx;
    auto small = Open(&ctx, {"gate"});  // 4 KiB fits next to the open 32 MiB
    int64_t bytes = 0;
    grpc::Status s = Drain(small.get(), &bytes);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(bytes, 128 * 8 * 4);
  }
  // SetWeights holds what it assembles too: wo (16 MiB) fits next to the open 32 MiB,
  // wi + wo (48 MiB) does not.
  const std::vector<int64_t> wi_shape = {8, 128, 8192}, wo_shape = {8, 4096, 128};
  grpc::Status set = SetWeights({{"wo", wo_shape}}, 0.25f);
  EXPECT_TRUE(set.ok()) << set.error_message();
  set = SetWeights({{"wi", wi_shape}, {"wo", wo_shape}}, 0.5f);
  EXPECT_EQ(set.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << set.error_message();
  EXPECT_THAT(set.error_message(), HasSubstr("--max_stream_bytes=67108864"));

  grpc::Status s = Drain(first.get(), &first_bytes);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(first_bytes, kWiBytes);
  set = SetWeights({{"wi", wi_shape}, {"wo", wo_shape}}, 0.5f);  // alone now: applied
  EXPECT_TRUE(set.ok()) << set.error_message();
  grpc::ClientContext ctx;
  auto again = Open(&ctx, {});  // alone now: served
  int64_t bytes = 0;
  s = Drain(again.get(), &bytes);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(bytes, kAllBytes);
}

// --handler_threads: with its one handler thread held by a stream nobody reads, moed refuses
// a Forward at once (RESOURCE_EXHAUSTED, no queueing behind it) while the calls that only read
// its books (GetLayer, GetStatus) still answer; when the stream ends, the Forward runs.
TEST_F(BigLayerTest, BusyHandlersRefuseCallsAtOnce) {
  Start({"--handler_threads=1"});
  grpc::ClientContext stream_ctx;
  auto stream = Open(&stream_ctx, {"wi"});
  v1::TensorChunk chunk;
  ASSERT_TRUE(stream->Read(&chunk));
  grpc::Status s = Forward();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("all 1 handler threads are busy"));
  {
    grpc::ClientContext ctx;
    v1::GetLayerRequest request;
    request.set_name("big");
    v1::GetLayerResponse response;
    EXPECT_TRUE(stub_->GetLayer(&ctx, request, &response).ok());
    grpc::ClientContext ctx2;
    v1::GetStatusResponse status;
    EXPECT_TRUE(stub_->GetStatus(&ctx2, v1::GetStatusRequest(), &status).ok());
  }
  int64_t bytes = static_cast<int64_t>(chunk.raw_data().size());
  ASSERT_TRUE(Drain(stream.get(), &bytes).ok());
  EXPECT_EQ(bytes, kWiBytes);
  // The thread is free a moment after the stream's status went out.
  const absl::Time give_up = absl::Now() + absl::Seconds(2);
  do {
    s = Forward();
  } while (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED && absl::Now() < give_up);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// --stream_idle_timeout_s: a GetWeights stream whose client never reads is cancelled after the
// timeout (the probe's 10 unread streams held ~390 MB each and every handler thread): its
// handler thread and its bytes of --max_stream_bytes are free again, so a stream that would
// not fit next to it and a Forward on the only handler thread are served.
TEST_F(BigLayerTest, UnreadStreamsAreCancelled) {
  Start({"--stream_idle_timeout_s=3", "--max_stream_bytes=67108864", "--handler_threads=1"});
  grpc::ClientContext idle_ctx;
  idle_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
  v1::GetWeightsRequest request;
  request.set_layer("big");
  request.add_names("wi");
  request.set_max_chunk_bytes(65536);
  auto idle = stub_->GetWeights(&idle_ctx, request);
  v1::TensorChunk chunk;
  ASSERT_TRUE(idle->Read(&chunk));  // moed has gathered wi (32 MiB); nobody reads on
  int64_t idle_bytes = static_cast<int64_t>(chunk.raw_data().size());
  grpc::Status s = Forward();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  // Within a generous bound after the timeout, the thread and the budget are free again.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  do {
    absl::SleepFor(absl::Milliseconds(200));
    s = Forward();
  } while (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED && absl::Now() < give_up);
  EXPECT_TRUE(s.ok()) << s.error_message();
  grpc::ClientContext ctx;
  auto all = Open(&ctx, {});  // 48 MiB: would not fit next to the idle stream's 32 MiB
  int64_t bytes = 0;
  s = Drain(all.get(), &bytes);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(bytes, kAllBytes);
  // The idle stream itself ended cancelled, with fewer bytes than wi.
  s = Drain(idle.get(), &idle_bytes);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_LT(idle_bytes, kWiBytes);
  EXPECT_EQ(cluster_->Health().value_or("error"), "SERVING");
}

}  // namespace
}  // namespace moe
