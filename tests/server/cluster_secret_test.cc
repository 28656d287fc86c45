// The cluster secret: generated ones are 64 hex digits and differ; files and inherited fds are
// read (trailing newline dropped, short or non-printable secrets refused); an in-process server
// that checks it answers UNAUTHENTICATED without it, PERMISSION_DENIED with another one, and
// serves a channel made by Channel().
#include "server/cluster_secret.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(ClusterSecretTest, GeneratedSecretsAreRandomHex) {
  absl::StatusOr<ClusterSecret> a = ClusterSecret::Generate();
  absl::StatusOr<ClusterSecret> b = ClusterSecret::Generate();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->value().size(), 64u);
  EXPECT_EQ(a->value().find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a->value(), b->value());
}

TEST(ClusterSecretTest, FromFileAndFd) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp ? tmp : "/tmp", "/secret_", getpid());
  const std::string value = "0123456789abcdef0123456789abcdef";
  std::ofstream(path) << value << "\n";
  absl::StatusOr<ClusterSecret> read = ClusterSecret::FromFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->value(), value);
  std::ofstream(path) << "short\n";
  EXPECT_EQ(ClusterSecret::FromFile(path).status().code(), absl::StatusCode::kInvalidArgument);
  std::ofstream(path) << value << " with a space\n";
  EXPECT_EQ(ClusterSecret::FromFile(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ClusterSecret::FromFile(path + ".missing").status().code(),
            absl::StatusCode::kNotFound);

  absl::StatusOr<int> fd = read->ToMemfd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  const int copy = dup(*fd);
  absl::StatusOr<ClusterSecret> from_fd = ClusterSecret::FromFd(*fd);  // closes *fd
  ASSERT_TRUE(from_fd.ok()) << from_fd.status();
  EXPECT_EQ(from_fd->value(), value);
  EXPECT_TRUE(ClusterSecret::FromFd(copy).ok());  // pread: the shared offset does not matter
}

// A server whose only method (the generic one) checks the secret.
class EchoSecret final : public grpc::CallbackGenericService {
 public:
  explicit EchoSecret(const ClusterSecret* secret) : secret_(secret) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    class Reactor : public grpc::ServerGenericBidiReactor {
     public:
      explicit Reactor(grpc::Status status) { Finish(status); }
      void OnDone() override { delete this; }
    };
    return new Reactor(secret_->Check(*context));
  }

 private:
  const ClusterSecret* secret_;
};

TEST(ClusterSecretTest, CheckRefusesMissingAndWrongSecrets) {
  absl::StatusOr<ClusterSecret> secret = ClusterSecret::Generate();
  absl::StatusOr<ClusterSecret> other = ClusterSecret::Generate();
  ASSERT_TRUE(secret.ok() && other.ok());
  EchoSecret service(&*secret);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  auto call = [&](std::shared_ptr<grpc::Channel> channel) {
    grpc::GenericStub stub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::ByteBuffer request, response;
    grpc::Slice slice(std::string("x"));
    request = grpc::ByteBuffer(&slice, 1);
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    stub.UnaryCall(&context, "/any.Service/Method", grpc::StubOptions(), &request, &response,
                   [&](grpc::Status s) {
                     std::lock_guard<std::mutex> lock(mu);
                     status = s;
                     done = true;
                     cv.notify_one();
                   });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return status;
  };
  grpc::ChannelArguments args;
  EXPECT_EQ(call(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call(other->Channel(address, args)).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(call(secret->Channel(address, args)).ok());
  server->Shutdown();
}

}  // namespace
}  // namespace moe
