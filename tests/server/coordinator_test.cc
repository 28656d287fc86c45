// moed's Coordinator service behind an in-process gRPC server (the callback API as moed runs
// it): callers without the cluster secret are refused before anything else; StoreSet answers
// on gRPC's thread even while StoreGets that wait for it fill the handler pool; a call that
// would block beyond the pool is RESOURCE_EXHAUSTED; waiting StoreGets are bounded by the
// store (per caller and in total) below the pool; and a waiting StoreGet ends when the server
// shuts down instead of holding the shutdown until its timeout.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator_service.h"
#include "server/worker_pool.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr char kSecret[] = "0123456789abcdef0123456789abcdef-coordinator-test";

std::unique_ptr<grpc::ClientContext> Context(int seconds) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return context;
}

ClusterSecret Secret() { return *ClusterSecret::FromString(kSecret); }

class CoordinatorTest : public ::testing::Test {
 protected:
  void Start(RendezvousLimits limits, int max_handlers) {
    WorkerPoolOptions options;
    options.world_size = 2;
    pool_ = std::make_unique<WorkerPool>(options, Secret());
    store_ = std::make_unique<RendezvousStore>(limits);
    coordinator_ =
        std::make_unique<CoordinatorService>(pool_.get(), store_.get(), Secret(), max_handlers);
    grpc::ServerBuilder builder;
    builder.RegisterService(coordinator_.get());
    server_ = builder.BuildAndStart();
    stub_ = internal::Coordinator::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  // Contexts of members carry the secret in their metadata.
  std::unique_ptr<grpc::ClientContext> Member(int seconds) {
    auto context = Context(seconds);
    context->AddMetadata(kClusterSecretMetadata, kSecret);
    return context;
  }
  grpc::Status Get(const std::string& key, internal::StoreGetResponse* value) {
    internal::StoreGetRequest get;
    get.set_key(key);
    get.set_timeout_ms(60000);
    return stub_->StoreGet(Member(60).get(), get, value);
  }
  grpc::Status Set(const std::string& key, const std::string& value) {
    internal::StoreSetRequest set;
    set.set_key(key);
    set.set_value(value);
    internal::StoreSetResponse response;
    return stub_->StoreSet(Member(10).get(), set, &response);
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<RendezvousStore> store_;
  std::unique_ptr<CoordinatorService> coordinator_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<internal::Coordinator::Stub> stub_;
};

TEST_F(CoordinatorTest, StoreGetWaitsForSetAndEndsAtShutdown) {
  Start(RendezvousLimits{}, /*max_handlers=*/1);
  // A StoreGet fills the pool; the StoreSet it waits for still gets through.
  grpc::Status got;
  internal::StoreGetResponse value;
  std::thread waiter([&] { got = Get("g1/a", &value); });
  absl::SleepFor(absl::Milliseconds(300));
  internal::JoinRequest join;
  join.set_address("127.0.0.1:1");
  internal::JoinResponse joined;
  grpc::Status refused = stub_->Join(Member(10).get(), join, &joined);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  grpc::Status stored = Set("g1/a", "address of a");
  EXPECT_TRUE(stored.ok()) << stored.error_message();
  waiter.join();
  ASSERT_TRUE(got.ok()) << got.error_message();
  EXPECT_EQ(value.value(), "address of a");

  // A key that never comes: the wait ends with the server's shutdown, not at 60 s.
  waiter = std::thread([&] { got = Get("g1/never", &value); });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  waiter.join();
  EXPECT_FALSE(got.ok());
  server_.reset();
}

// Join, StoreSet and StoreGet without the secret: UNAUTHENTICATED; with another one:
// PERMISSION_DENIED. Nothing is stored, nothing joins.
TEST_F(CoordinatorTest, CallersWithoutTheSecretAreRefused) {
  Start(RendezvousLimits{}, /*max_handlers=*/4);
  for (const char* secret : {"", "wrong-secret-wrong-secret-wrong-secret"}) {
    const grpc::StatusCode expected =
        secret[0] == '\0' ? grpc::StatusCode::UNAUTHENTICATED : grpc::StatusCode::PERMISSION_DENIED;
    auto context = [&] {
      auto c = Context(10);
      if (secret[0] != '\0') c->AddMetadata(kClusterSecretMetadata, secret);
      return c;
    };
    internal::JoinRequest join;
    join.set_address("127.0.0.1:1");
    internal::JoinResponse joined;
    grpc::Status s = stub_->Join(context().get(), join, &joined);
    EXPECT_EQ(s.error_code(), expected) << s.error_message();
    internal::StoreSetRequest set;
    set.set_key("g1/a");
    set.set_value(std::string(1 << 20, 'x'));
    internal::StoreSetResponse set_response;
    s = stub_->StoreSet(context().get(), set, &set_response);
    EXPECT_EQ(s.error_code(), expected) << s.error_message();
    internal::StoreGetRequest get;
    get.set_key("g1/a");
    get.set_timeout_ms(60000);
    internal::StoreGetResponse value;
    s = stub_->StoreGet(context().get(), get, &value);
    EXPECT_EQ(s.error_code(), expected) << s.error_message();
  }
  EXPECT_EQ(store_->keys(), 0);
  for (const v1::WorkerStatus& w : pool_->WorkerStatuses()) EXPECT_FALSE(w.alive());
}

// Waiting StoreGets stop at --rendezvous_max_waiting_per_caller (one connection) and
// --rendezvous_max_waiting (all), far below the handler pool: a Join still gets a thread.
TEST_F(CoordinatorTest, WaitingStoreGetsAreBounded) {
  RendezvousLimits limits;
  limits.max_waiting = 3;
  limits.max_waiting_per_caller = 2;
  Start(limits, /*max_handlers=*/8);
  std::vector<std::thread> waiters;
  std::vector<grpc::Status> got(2);
  std::vector<internal::StoreGetResponse> values(2);
  for (int i = 0; i < 2; ++i) {
    waiters.emplace_back([&, i] { got[i] = Get("g1/later", &values[i]); });
  }
  absl::SleepFor(absl::Milliseconds(500));
  internal::StoreGetResponse value;
  grpc::Status s = Get("g1/later", &value);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--rendezvous_max_waiting_per_caller=2"));
  // A key that is there is answered at once, waiting bound or not.
  ASSERT_TRUE(Set("g1/now", "v").ok());
  EXPECT_TRUE(Get("g1/now", &value).ok());
  // Joins still find a handler thread.
  internal::JoinRequest join;
  join.set_address("127.0.0.1:1");
  internal::JoinResponse joined;
  grpc::Status join_status = stub_->Join(Member(10).get(), join, &joined);
  EXPECT_TRUE(join_status.ok()) << join_status.error_message();
  ASSERT_TRUE(Set("g1/later", "v").ok());
  for (std::thread& t : waiters) t.join();
  for (const grpc::Status& g : got) EXPECT_TRUE(g.ok()) << g.error_message();
}

}  // namespace
}  // namespace moe
