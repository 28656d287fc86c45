// The internal plane against an outsider and a misbehaving member, on a real moed with 2
// moe-worker processes (the probe's findings of issue 13):
//   - every Worker RPC (Shutdown, Setup, Forward, ...: all methods of the service) and every
//     Coordinator RPC refuses a caller without the cluster secret (UNAUTHENTICATED) or with
//     another one (PERMISSION_DENIED); nothing restarts, the cluster stays SERVING;
//   - Join with a live worker's address and pid (read from GetStatus), replayed, is refused
//     (FAILED_PRECONDITION) and forwards keep succeeding;
//   - the rendezvous store refuses junk keys, values past --rendezvous_max_bytes and earlier
//     generations' keys, and waiting StoreGets past --rendezvous_max_waiting_per_caller; while
//     they wait, a killed worker rejoins.
#include <grpcpp/generic/generic_stub.h>
#include <signal.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr char kSecretKey[] = "x-moe-cluster-secret";
constexpr char kWrongSecret[] = "not-the-secret-not-the-secret-not-the-secret";

class InternalPlaneTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ClusterOptions options;
    options.moed_flags = {"--rendezvous_max_bytes=1048576",
                          "--rendezvous_max_waiting_per_caller=4"};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
    grpc::ClientContext ctx;
    v1::CreateLayerRequest request;
    request.set_name("ffn");
    *request.mutable_config() = TinyConfig(/*seed=*/5);
    v1::CreateLayerResponse response;
    grpc::Status s = cluster_->stub()->CreateLayer(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  // A context carrying `secret` ("" none; "member": the cluster's own).
  static std::unique_ptr<grpc::ClientContext> Context(const std::string& secret, int seconds = 10) {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
    if (secret == "member") {
      context->AddMetadata(kSecretKey, cluster_->cluster_secret());
    } else if (!secret.empty()) {
      context->AddMetadata(kSecretKey, secret);
    }
    return context;
  }
  static v1::GetStatusResponse Status() {
    grpc::ClientContext ctx;
    v1::GetStatusResponse status;
    EXPECT_TRUE(cluster_->stub()->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
    return status;
  }
  static grpc::Status Forward() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ForwardRequest request;
    request.set_layer("ffn");
    *request.mutable_x() = FloatsToProto({4, 32}, RandomFloats(4 * 32, 1));
    v1::ForwardResponse response;
    return cluster_->stub()->Forward(&ctx, request, &response);
  }
  // A generic unary call of `method` ("/pkg.Service/Method") with an empty message.
  static grpc::Status CallEmpty(const std::string& address, const std::string& method,
                                const std::string& secret) {
    return CallBytes(address, method, secret, "");
  }
  // The same with `bytes` as the message.
  static grpc::Status CallBytes(const std::string& address, const std::string& method,
                                const std::string& secret, const std::string& bytes) {
    grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    std::unique_ptr<grpc::ClientContext> context = Context(secret);
    grpc::ByteBuffer request, response;
    grpc::Slice message(bytes);
    request = grpc::ByteBuffer(&message, 1);
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(context.get(), method, grpc::StubOptions(), &request, &response,
                   [&](grpc::Status s) {
                     status = s;
                     done.Notify();
                   });
    done.WaitForNotification();
    return status;
  }
  // The cluster is SERVING with the same generation and worker processes, and steps run.
  static void ExpectUndisturbed(const v1::GetStatusResponse& before) {
    EXPECT_EQ(cluster_->Health().value_or("error"), "SERVING");
    v1::GetStatusResponse after = Status();
    EXPECT_EQ(after.generation(), before.generation());
    ASSERT_EQ(after.workers_size(), before.workers_size());
    for (int r = 0; r < after.workers_size(); ++r) {
      EXPECT_TRUE(after.workers(r).alive()) << r;
      EXPECT_EQ(after.workers(r).pid(), before.workers(r).pid()) << r;
    }
    grpc::Status s = Forward();
    EXPECT_TRUE(s.ok()) << s.error_message();
  }

  static inline TestCluster* cluster_ = nullptr;
};

TEST_F(InternalPlaneTest, EveryWorkerRpcRefusesCallersWithoutTheSecret) {
  const v1::GetStatusResponse before = Status();
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          internal::Worker::service_full_name());
  ASSERT_NE(service, nullptr);
  ASSERT_GE(service->method_count(), 15);
  for (const v1::WorkerStatus& worker : before.workers()) {
    for (int m = 0; m < service->method_count(); ++m) {
      const std::string method =
          absl::StrCat("/", service->full_name(), "/", service->method(m)->name());
      grpc::Status s = CallEmpty(worker.address(), method, "");
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << method << ": " << s.error_message();
      s = CallEmpty(worker.address(), method, kWrongSecret);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
          << method << ": " << s.error_message();
    }
  }
  // The workers' health service stays open to probes.
  EXPECT_EQ(HealthOf(before.workers(0).address(), "").value_or("error"), "SERVING");
  ExpectUndisturbed(before);
}

// The workers split Forward/Backward requests by hand (proto/tensor_wire.h): input protobuf
// would not parse is INVALID_ARGUMENT, and the worker keeps serving.
TEST_F(InternalPlaneTest, WorkerStepsRefuseMalformedRequests) {
  const v1::GetStatusResponse before = Status();
  const std::vector<std::string> malformed = {
      std::string("\x22\x05\x61\x62", 4),          // x: 5 bytes announced, 2 sent
      std::string("\x22\x04\x1a\x09\x61\x62", 6),  // x.raw_data runs past x's end
      std::string("\x22\x02\x12\x80", 4),          // x.shape: a varint cut short
      std::string("\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", 12),  // overlong varint
      std::string("\x00", 1),                                               // field 0
      std::string("\x0c", 1),  // an end-group tag out of a group
  };
  for (const char* method : {"/moe.internal.Worker/Forward", "/moe.internal.Worker/Backward"}) {
    for (const std::string& bytes : malformed) {
      grpc::Status s = CallBytes(before.workers(0).address(), method, "member", bytes);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << method << ": " << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("request does not parse")) << method;
    }
  }
  ExpectUndisturbed(before);
}

TEST_F(InternalPlaneTest, CoordinatorRefusesCallersWithoutTheSecret) {
  const v1::GetStatusResponse before = Status();
  auto stub = internal::Coordinator::NewStub(
      grpc::CreateChannel(cluster_->internal_address(), grpc::InsecureChannelCredentials()));
  for (const std::string& secret : {std::string(), std::string(kWrongSecret)}) {
    const grpc::StatusCode expected =
        secret.empty() ? grpc::StatusCode::UNAUTHENTICATED : grpc::StatusCode::PERMISSION_DENIED;
    internal::JoinRequest join;
    join.set_requested_rank(1);
    join.set_address(before.workers(1).address());
    join.set_pid(before.workers(1).pid());
    internal::JoinResponse joined;
    grpc::Status s = stub->Join(Context(secret).get(), join, &joined);
    EXPECT_EQ(s.error_code(), expected) << s.error_message();
    internal::StoreSetRequest set;
    set.set_key("g1/junk");
    set.set_value(std::string(100 << 10, 'x'));
    internal::StoreSetResponse set_response;
    s = stub->StoreSet(Context(secret).get(), set, &set_response);
    EXPECT_EQ(s.error_code(), expected) << s.error_message();
    internal::StoreGetRequest get;
    get.set_key("g1/never");
    get.set_timeout_ms(600000);
    internal::StoreGetResponse value;
    s = stub->StoreGet(Context(secret).get(), get, &value);
    EXPECT_EQ(s.error_code(), expected) << s.error_message();
  }
  ExpectUndisturbed(before);
}

// The probe re-joined a live worker's address and pid every 0.5 s: 537 of 769 forwards failed.
TEST_F(InternalPlaneTest, JoinRefusesALiveWorkersAddress) {
  const v1::GetStatusResponse before = Status();
  auto stub = internal::Coordinator::NewStub(
      grpc::CreateChannel(cluster_->internal_address(), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 4; ++i) {
    for (int rank : {-1, 0, 1}) {
      const v1::WorkerStatus& victim = before.workers(i % 2);
      internal::JoinRequest join;
      join.set_requested_rank(rank);
      join.set_address(victim.address());
      join.set_pid(victim.pid());
      internal::JoinResponse joined;
      grpc::Status s = stub->Join(Context("member").get(), join, &joined);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
          << "rank " << rank << ": " << s.error_message();
    }
    grpc::Status forward = Forward();
    EXPECT_TRUE(forward.ok()) << forward.error_message();
  }
  ExpectUndisturbed(before);
}

TEST_F(InternalPlaneTest, RendezvousStoreIsBounded) {
  const v1::GetStatusResponse before = Status();
  auto stub = internal::Coordinator::NewStub(
      grpc::CreateChannel(cluster_->internal_address(), grpc::InsecureChannelCredentials()));
  internal::StoreSetResponse set_response;
  internal::StoreSetRequest set;
  set.set_key("junk");
  grpc::Status s = stub->StoreSet(Context("member").get(), set, &set_response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  set.set_key(absl::StrCat("g", before.generation(), "/big"));
  set.set_value(std::string(2 << 20, 'x'));
  s = stub->StoreSet(Context("member").get(), set, &set_response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--rendezvous_max_bytes=1048576"));

  // Waiting StoreGets of one caller stop at --rendezvous_max_waiting_per_caller.
  constexpr int kParked = 4;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<grpc::Status> parked(kParked);
  std::vector<std::thread> threads;
  internal::StoreGetRequest get;
  get.set_key("g999999/never");
  get.set_timeout_ms(600000);
  for (int i = 0; i < kParked; ++i) {
    contexts.push_back(Context("member", 600));
    threads.emplace_back([&, i] {
      internal::StoreGetResponse value;
      parked[i] = stub->StoreGet(contexts[i].get(), get, &value);
    });
  }
  absl::SleepFor(absl::Seconds(1));
  internal::StoreGetResponse value;
  s = stub->StoreGet(Context("member").get(), get, &value);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--rendezvous_max_waiting_per_caller=4"));
  ExpectUndisturbed(before);

  // While they wait, a killed worker rejoins and the cluster re-forms (new generation).
  ASSERT_TRUE(cluster_->KillWorker(1, SIGKILL));
  ASSERT_TRUE(cluster_->RestartWorker(1).ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  v1::GetStatusResponse after;
  do {
    absl::SleepFor(absl::Milliseconds(100));
    after = Status();
  } while (!(after.serving() && after.generation() > before.generation()) && absl::Now() < give_up);
  ASSERT_TRUE(after.serving()) << after.message();
  ASSERT_GT(after.generation(), before.generation());
  // Keys of the earlier generation were dropped and cannot be written again.
  set.set_key(absl::StrCat("g", before.generation(), "/late"));
  set.set_value("v");
  s = stub->StoreSet(Context("member").get(), set, &set_response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();

  for (auto& context : contexts) context->TryCancel();
  for (std::thread& t : threads) t.join();
  for (const grpc::Status& p : parked) EXPECT_FALSE(p.ok());
  EXPECT_EQ(cluster_->Health().value_or("error"), "SERVING");
  s = Forward();
  EXPECT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace moe
