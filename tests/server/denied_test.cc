// The front end alone (no worker joins) with a tokens file: calls refused by the role check
// are counted in moed_denied_total{role,code}, and a refused stream takes no handler thread
// (with the only thread busy, a wrong-role stream is PERMISSION_DENIED, not
// RESOURCE_EXHAUSTED).
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "tests/server/frontend_fixture.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

class DeniedTest : public FrontEndTest {
 protected:
  void SetUp() override {
    const std::string tokens = ::testing::TempDir() + "/denied_tokens";
    std::ofstream(tokens) << Sha256Hex("read-token") << " read\n"
                          << Sha256Hex("admin-token") << " admin\n";
    auto auth = TokenAuthenticator::Load(tokens);
    ASSERT_TRUE(auth.ok()) << auth.status();
    auth_ = std::move(*auth);
    ServiceOptions options;
    options.auth = auth_.get();
    options.handler_threads = 1;
    StartFrontEnd(options);
  }

  static void WithToken(grpc::ClientContext* ctx, const std::string& token) {
    ctx->AddMetadata("authorization", "Bearer " + token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  }
};

TEST_F(DeniedTest, RefusedCallsAreCountedByRoleAndCode) {
  grpc::ClientContext none;
  none.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::ListLayersResponse listed;
  EXPECT_EQ(stub_->ListLayers(&none, v1::ListLayersRequest(), &listed).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  grpc::ClientContext low;
  WithToken(&low, "read-token");
  v1::CreateLayerResponse created;
  EXPECT_EQ(stub_->CreateLayer(&low, v1::CreateLayerRequest(), &created).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  grpc::ClientContext allowed;
  WithToken(&allowed, "read-token");
  EXPECT_TRUE(stub_->ListLayers(&allowed, v1::ListLayersRequest(), &listed).ok());
  const std::string text = metrics_.Render();
  EXPECT_THAT(text, HasSubstr("moed_denied_total{code=\"16\",role=\"read\"} 1"));
  EXPECT_THAT(text, HasSubstr("moed_denied_total{code=\"7\",role=\"admin\"} 1"));
}

TEST_F(DeniedTest, ARefusedStreamTakesNoHandlerThread) {
  // An admin's ForwardStream that sends nothing holds the only handler thread.
  grpc::ClientContext holder;
  WithToken(&holder, "admin-token");
  auto held = stub_->ForwardStream(&holder);
  absl::SleepFor(absl::Milliseconds(300));
  // A read token may not run ForwardStream: refused for its role, not for a busy pool.
  grpc::ClientContext low;
  WithToken(&low, "read-token");
  auto refused = stub_->ForwardStream(&low);
  refused->WritesDone();
  grpc::Status status = refused->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  grpc::ClientContext no_token;
  no_token.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::GetWeightsRequest request;
  auto reader = stub_->GetWeights(&no_token, request);
  v1::TensorChunk chunk;
  while (reader->Read(&chunk)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  held->WritesDone();
  held->Finish();
}

}  // namespace
}  // namespace moe
