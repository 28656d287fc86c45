// moed's Coordinator service behind an in-process gRPC server (the callback API as moed runs
// it): StoreSet answers on gRPC's thread even while StoreGets that wait for it fill the
// handler pool, a call that would block beyond the pool is RESOURCE_EXHAUSTED, and a waiting
// StoreGet ends when the server shuts down instead of holding the shutdown until its timeout.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <thread>

#include "absl/time/clock.h"
#include "engine/comm/memory_kv_store.h"
#include "gtest/gtest.h"
#include "server/coordinator_service.h"
#include "server/worker_pool.h"

namespace moe {
namespace {

std::unique_ptr<grpc::ClientContext> Context(int seconds) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return context;
}

TEST(CoordinatorTest, StoreGetWaitsForSetAndEndsAtShutdown) {
  WorkerPoolOptions options;
  options.world_size = 2;
  WorkerPool pool(options);
  CoordinatorService coordinator(&pool, std::make_shared<MemoryKeyValueStore>(),
                                 /*max_handlers=*/1);
  grpc::ServerBuilder builder;
  builder.RegisterService(&coordinator);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  std::unique_ptr<internal::Coordinator::Stub> stub =
      internal::Coordinator::NewStub(server->InProcessChannel(grpc::ChannelArguments()));

  // A StoreGet fills the pool; the StoreSet it waits for still gets through.
  internal::StoreGetRequest get;
  get.set_key("a");
  get.set_timeout_ms(60000);
  grpc::Status got;
  internal::StoreGetResponse value;
  std::thread waiter([&] { got = stub->StoreGet(Context(60).get(), get, &value); });
  absl::SleepFor(absl::Milliseconds(300));
  internal::JoinRequest join;
  join.set_address("127.0.0.1:1");
  internal::JoinResponse joined;
  grpc::Status refused = stub->Join(Context(10).get(), join, &joined);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  internal::StoreSetRequest set;
  set.set_key("a");
  set.set_value("address of a");
  internal::StoreSetResponse set_response;
  grpc::Status stored = stub->StoreSet(Context(10).get(), set, &set_response);
  EXPECT_TRUE(stored.ok()) << stored.error_message();
  waiter.join();
  ASSERT_TRUE(got.ok()) << got.error_message();
  EXPECT_EQ(value.value(), "address of a");

  // A key that never comes: the wait ends with the server's shutdown, not at 60 s.
  get.set_key("never");
  waiter = std::thread([&] { got = stub->StoreGet(Context(60).get(), get, &value); });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  waiter.join();
  EXPECT_FALSE(got.ok());
}

}  // namespace
}  // namespace moe
