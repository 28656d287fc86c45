// moed's step rings to a worker refill after timeouts (server/worker_rings.h): a channel whose
// call passed its deadline is dropped (the worker may still answer on it) and a new one is
// opened in its place, so a run of timeouts does not leave the worker on gRPC. Both sides are
// the real ones (WorkerRings as moed uses it, WorkerRingServer as moe-worker serves it) with
// an in-process Worker service whose OpenStepChannels is the worker's; this process is both
// "moed" and "the worker", so the pid checks pass as they do on one host.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"
#include "server/worker_ring_server.h"
#include "server/worker_rings.h"

namespace moe {
namespace {

// A worker that answers each record with its body, after `hold` for a body of "slow".
class RingWorker final : public internal::Worker::Service {
 public:
  RingWorker()
      : rings_([this](uint8_t, absl::Time, absl::string_view body) -> absl::StatusOr<std::string> {
          if (body == "slow") absl::SleepFor(absl::Milliseconds(hold_ms_.load()));
          ++answered_;
          return std::string(body);
        }) {}
  grpc::Status OpenStepChannels(grpc::ServerContext*,
                                const internal::OpenStepChannelsRequest* request,
                                internal::OpenStepChannelsResponse* response) override {
    ++opens_;
    rings_.Open(*request, response);
    return grpc::Status::OK;
  }
  std::atomic<int> hold_ms_{400};
  std::atomic<int> answered_{0};
  std::atomic<int> opens_{0};
  WorkerRingServer rings_;
};

grpc::ByteBuffer Bytes(absl::string_view s) {
  grpc::Slice slice(s.data(), s.size());
  return grpc::ByteBuffer(&slice, 1);
}

struct Fixture {
  Fixture() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&worker);
    server = builder.BuildAndStart();
    stub = internal::Worker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                            grpc::InsecureChannelCredentials()));
  }
  ~Fixture() { server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1))); }
  RingWorker worker;
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<internal::Worker::Stub> stub;
};

absl::StatusOr<std::string> Call(WorkerRings& rings, absl::string_view body,
                                 absl::Duration timeout) {
  std::optional<absl::StatusOr<std::string>> answer =
      rings.Call(WorkerRingKind::kForward, Bytes(body), absl::Now() + timeout, nullptr);
  if (!answer.has_value()) return absl::UnavailableError("not sent: no free channel");
  return *answer;
}

bool WaitFor(const std::function<bool()>& done, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

TEST(WorkerRingsRefillTest, ChannelsDroppedAfterTimeoutsAreReplaced) {
  Fixture f;
  WorkerRingOptions options;
  options.channels_per_worker = 2;
  std::shared_ptr<WorkerRings> rings = WorkerRings::Open(0, 1, getpid(), f.stub, options);
  ASSERT_NE(rings, nullptr);
  ASSERT_EQ(rings->channels(), 2);
  EXPECT_EQ(*Call(*rings, "fast", absl::Seconds(5)), "fast");
  // More timeouts than channels: without the refill the worker would be left on gRPC.
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(WaitFor([&] { return rings->free_channels() > 0; }, absl::Seconds(10)))
        << "no channel came back after timeout " << i;
    absl::StatusOr<std::string> late = Call(*rings, "slow", absl::Milliseconds(30));
    EXPECT_TRUE(absl::IsDeadlineExceeded(late.status())) << late.status();
  }
  ASSERT_TRUE(WaitFor([&] { return rings->channels() == 2 && rings->free_channels() == 2; },
                      absl::Seconds(10)))
      << "channels " << rings->channels() << ", free " << rings->free_channels();
  EXPECT_EQ(rings->refilled(), 5);
  EXPECT_EQ(f.worker.opens_.load(), 1 + 5);
  // The new channels carry steps, and no late answer of a dropped one is read as theirs.
  f.worker.hold_ms_ = 0;
  for (int i = 0; i < 20; ++i) {
    const std::string body = "step-" + std::to_string(i);
    EXPECT_EQ(*Call(*rings, body, absl::Seconds(5)), body);
  }
}

TEST(WorkerRingsRefillTest, AWorkerThatStopsAnsweringOpensLeavesGrpc) {
  Fixture f;
  WorkerRingOptions options;
  options.channels_per_worker = 1;
  options.open_timeout = absl::Milliseconds(500);
  std::shared_ptr<WorkerRings> rings = WorkerRings::Open(0, 1, getpid(), f.stub, options);
  ASSERT_NE(rings, nullptr);
  f.server->Shutdown(absl::ToChronoTime(absl::Now()));  // the refill's OpenStepChannels fails
  EXPECT_TRUE(absl::IsDeadlineExceeded(Call(*rings, "slow", absl::Milliseconds(30)).status()));
  ASSERT_TRUE(WaitFor([&] { return rings->refilled() == 0 && rings->channels() == 0; },
                      absl::Seconds(5)));
  absl::SleepFor(absl::Seconds(1));  // the refill has given up by now
  EXPECT_EQ(rings->channels(), 0);
  EXPECT_EQ(rings->free_channels(), 0u);
  // Not sent: the caller goes over gRPC.
  EXPECT_FALSE(rings->Call(WorkerRingKind::kForward, Bytes("x"), absl::Now() + absl::Seconds(1),
                           nullptr)
                   .has_value());
}

TEST(WorkerRingsRefillTest, DestroyedWhileARefillIsInFlight) {
  Fixture f;
  WorkerRingOptions options;
  options.channels_per_worker = 1;
  options.open_timeout = absl::Seconds(30);
  std::shared_ptr<WorkerRings> rings = WorkerRings::Open(0, 1, getpid(), f.stub, options);
  ASSERT_NE(rings, nullptr);
  EXPECT_TRUE(absl::IsDeadlineExceeded(Call(*rings, "slow", absl::Milliseconds(30)).status()));
  const absl::Time start = absl::Now();
  rings.reset();  // joins the refill thread (cancelling its call if it is still in flight)
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace moe
