// Bounds on what requests in flight may hold in moed (issue 13, finding 4), on a real moed with
// 2 moe-worker processes:
//   - a request far over --max_message_bytes is refused (RESOURCE_EXHAUSTED) without moed
//     buffering it: the ResourceQuota (--max_inflight_bytes) stops the upload, moed's RSS
//     stays far below the request's size;
//   - ForwardStream steps whose announced tensors would pass --max_inflight_bytes together are
//     refused before a piece is read, naming the flag; the bytes come back when a step ends;
//   - one client's calls beyond --handler_threads_per_client are refused, naming the flag;
//     its calls pass again once earlier ones end;
// and the service is SERVING after each.
#include <grpcpp/generic/generic_stub.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;

// Resident memory of `pid`, bytes (0 if unreadable).
int64_t RssBytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  int64_t kib = 0;
  while (status >> key) {
    if (key == "VmRSS:" && status >> kib) return kib * 1024;
    status.ignore(1 << 10, '\n');
  }
  return 0;
}

std::unique_ptr<TestCluster> StartCluster(std::vector<std::string> flags) {
  ClusterOptions options;
  options.moed_flags = std::move(flags);
  auto cluster = TestCluster::Start(options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? std::move(*cluster) : nullptr;
}

TEST(LimitsTest, AnOversizedRequestIsRefusedBeforeMoedBuffersIt) {
  auto cluster = StartCluster({"--max_message_bytes=1048576", "--max_inflight_bytes=67108864"});
  ASSERT_NE(cluster, nullptr);
  const int64_t rss_before = RssBytes(cluster->moed_pid());
  ASSERT_GT(rss_before, 0);
  // 512 MiB of Forward request body (its content does not matter: it is never parsed).
  const int64_t size = 512 * kMiB;
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  grpc::GenericStub stub(
      grpc::CreateCustomChannel(cluster->address(), grpc::InsecureChannelCredentials(), args));
  grpc::Slice body(static_cast<size_t>(size));
  std::memset(const_cast<uint8_t*>(body.begin()), 0, body.size());
  grpc::ByteBuffer request(&body, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  absl::Notification done;
  grpc::Status status;
  const absl::Time start = absl::Now();
  stub.UnaryCall(&ctx, "/moe.v1.MoeService/Forward", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = s;
                   done.Notify();
                 });
  done.WaitForNotification();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_LT(took, absl::Seconds(20));
  // Without the quota, gRPC reads the whole message before it checks its size (measured:
  // +160 MiB and more for this request); with it, moed holds at most the quota's worth.
  const int64_t grown = RssBytes(cluster->moed_pid()) - rss_before;
  EXPECT_LT(grown, 128 * kMiB) << "moed's RSS grew by " << grown / kMiB << " MiB";
  EXPECT_EQ(*cluster->Health(), "SERVING");
  grpc::ClientContext list_ctx;
  v1::ListLayersResponse listed;
  EXPECT_TRUE(cluster->stub()->ListLayers(&list_ctx, v1::ListLayersRequest(), &listed).ok());
}

// Opens a ForwardStream whose first message announces x [tokens, 1024] float32 (4 KiB a
// token) and carries no bytes yet: moed admits or refuses it on the announced size alone.
struct OpenStep {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardResponse>> stream;
};
std::unique_ptr<OpenStep> Announce(TestCluster* cluster, int64_t tokens) {
  auto step = std::make_unique<OpenStep>();
  step->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  step->stream = cluster->stub()->ForwardStream(&step->ctx);
  v1::ForwardRequest first;
  first.set_layer("nothing-yet");
  first.mutable_x()->set_datatype("FP32");
  first.mutable_x()->add_shape(tokens);
  first.mutable_x()->add_shape(1024);
  EXPECT_TRUE(step->stream->Write(first));
  return step;
}

TEST(LimitsTest, StreamedStepsBeyondMaxInflightBytesAreRefusedUpFront) {
  auto cluster = StartCluster({"--max_message_bytes=1048576", "--max_inflight_bytes=67108864"});
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<OpenStep> a = Announce(cluster.get(), 12 * 1024);  // 48 MiB, admitted
  absl::SleepFor(absl::Milliseconds(500));                           // moed has read it
  std::unique_ptr<OpenStep> b = Announce(cluster.get(), 8 * 1024);   // +32 MiB: too much
  b->stream->WritesDone();
  grpc::Status refused = b->stream->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("--max_inflight_bytes"));
  // The first step ends (short of its bytes: the step's validation refuses it); its 48 MiB
  // are free again, so the same 32 MiB step is admitted and fails only its own validation.
  a->stream->WritesDone();
  grpc::Status ended = a->stream->Finish();
  EXPECT_NE(ended.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << ended.error_message();
  std::unique_ptr<OpenStep> c = Announce(cluster.get(), 8 * 1024);
  c->stream->WritesDone();
  grpc::Status admitted = c->stream->Finish();
  EXPECT_NE(admitted.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << admitted.error_message();
  EXPECT_EQ(*cluster->Health(), "SERVING");
}

TEST(LimitsTest, OneClientCannotTakeMoreThanItsHandlerThreads) {
  auto cluster = StartCluster({"--handler_threads_per_client=2"});
  ASSERT_NE(cluster, nullptr);
  // Two streams whose bodies wait for their first message hold this client's two threads.
  std::vector<std::unique_ptr<OpenStep>> held;
  for (int i = 0; i < 2; ++i) {
    auto step = std::make_unique<OpenStep>();
    step->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    step->stream = cluster->stub()->ForwardStream(&step->ctx);
    held.push_back(std::move(step));
  }
  absl::SleepFor(absl::Milliseconds(500));
  grpc::ClientContext ctx;
  v1::CreateLayerRequest create;
  create.set_name("ffn");
  *create.mutable_config() = TinyConfig(/*seed=*/3);
  v1::CreateLayerResponse created;
  grpc::Status refused = cluster->stub()->CreateLayer(&ctx, create, &created);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("--handler_threads_per_client=2"));
  // Calls that take no handler thread (they only read moed's books) still answer.
  grpc::ClientContext list_ctx;
  v1::ListLayersResponse listed;
  EXPECT_TRUE(cluster->stub()->ListLayers(&list_ctx, v1::ListLayersRequest(), &listed).ok());
  for (auto& step : held) {
    step->stream->WritesDone();
    step->stream->Finish();
  }
  grpc::ClientContext again;
  grpc::Status ok = cluster->stub()->CreateLayer(&again, create, &created);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(*cluster->Health(), "SERVING");
}

}  // namespace
}  // namespace moe
