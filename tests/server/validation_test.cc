// The front end alone, with no worker ever joining: every request is validated before any
// worker is involved, so a bad request gets its own code (not UNAVAILABLE), a valid one that
// needs the workers gets UNAVAILABLE, and the read-only RPCs work.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/frontend_fixture.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

class ValidationTest : public FrontEndTest {
 protected:
  void SetUp() override { StartFrontEnd(ServiceOptions{}); }

  grpc::Status Create(const std::string& name, const v1::LayerConfig& config) {
    grpc::ClientContext ctx;
    v1::CreateLayerRequest request;
    request.set_name(name);
    *request.mutable_config() = config;
    v1::CreateLayerResponse response;
    return stub_->CreateLayer(&ctx, request, &response);
  }
};

TEST_F(ValidationTest, BadConfigsNameTheirField) {
  struct Case {
    const char* field;
    std::function<void(v1::LayerConfig*)> edit;
  };
  const std::vector<Case> cases = {
      {"hidden", [](v1::LayerConfig* c) { c->set_hidden(0); }},
      {"ffn", [](v1::LayerConfig* c) { c->set_ffn(-4); }},
      {"top_k", [](v1::LayerConfig* c) { c->set_top_k(9); }},
      {"num_experts", [](v1::LayerConfig* c) { c->set_num_experts(7); }},
      {"expert_bias", [](v1::LayerConfig* c) { c->set_use_expert_bias(true); }},
      {"compute_dtype", [](v1::LayerConfig* c) { c->set_compute_dtype("FP64"); }},
      {"group",
       [](v1::LayerConfig* c) {
         c->set_num_groups(3);
         c->set_group_topk(1);
       }},
  };
  for (const Case& c : cases) {
    v1::LayerConfig config = TinyConfig(1);
    c.edit(&config);
    grpc::Status s = Create("layer", config);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_THAT(s.error_message(), HasSubstr(c.field)) << s.error_message();
  }
  grpc::ClientContext ctx;
  v1::CreateLayerRequest no_config;
  no_config.set_name("x");
  v1::CreateLayerResponse response;
  EXPECT_THAT(stub_->CreateLayer(&ctx, no_config, &response).error_message(), HasSubstr("config"));
  EXPECT_EQ(Create("", TinyConfig(1)).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ValidationTest, ValidRequestsNeedTheWorkers) {
  grpc::Status s = Create("layer", TinyConfig(1));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("waiting for 2 worker"));
  // The failed creation left nothing behind.
  grpc::ClientContext ctx;
  v1::ListLayersResponse layers;
  ASSERT_TRUE(stub_->ListLayers(&ctx, v1::ListLayersRequest(), &layers).ok());
  EXPECT_EQ(layers.layers_size(), 0);
  grpc::ClientContext ctx2;
  v1::ForwardRequest forward;
  forward.set_layer("layer");
  v1::ForwardResponse out;
  EXPECT_EQ(stub_->Forward(&ctx2, forward, &out).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx3;
  v1::GetStatusResponse status;
  ASSERT_TRUE(stub_->GetStatus(&ctx3, v1::GetStatusRequest(), &status).ok());
  EXPECT_FALSE(status.serving());
  ASSERT_EQ(status.workers_size(), 2);
  EXPECT_FALSE(status.workers(0).alive());
  EXPECT_EQ(status.workers(0).error(), "not joined yet");
}

// Absurd sizes are the config's error before any memory estimate: a gated FFN of width
// F > 2^62 has up = 2F past int64, which once wrapped negative and let the layer through.
TEST_F(ValidationTest, AbsurdSizesAreInvalidBeforeAnyEstimate) {
  for (int64_t ffn : {int64_t{1} << 62, int64_t{(1ull << 63) - 1}}) {
    v1::LayerConfig config = TinyConfig(1);
    config.set_hidden(1);
    config.set_ffn(ffn);
    grpc::Status s = Create("huge", config);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << ffn << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("config.ffn: must be <= 262144"));
  }
}

// A streamed step's first message names it; a later one carries only the next piece of the
// tensor's raw_data. One that names another layer or datatype is refused, not appended.
TEST_F(ValidationTest, StreamFollowUpsNamingAnotherLayerOrDatatypeAreRefused) {
  v1::ForwardRequest first;
  first.set_layer("ffn0");
  *first.mutable_x() = FloatsToProto({4, 32}, RandomFloats(4 * 32, 1));
  first.mutable_x()->mutable_raw_data()->resize(2 * 32 * sizeof(float));  // half the rows
  for (const auto& change : std::vector<std::pair<const char*, void (*)(v1::ForwardRequest*)>>{
           {"layer", [](v1::ForwardRequest* r) { r->set_layer("other"); }},
           {"x.datatype", [](v1::ForwardRequest* r) { r->mutable_x()->set_datatype("BF16"); }},
           {"x.shape", [](v1::ForwardRequest* r) { r->mutable_x()->add_shape(4); }}}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto stream = stub_->ForwardStream(&ctx);
    ASSERT_TRUE(stream->Write(first));
    v1::ForwardRequest piece;
    piece.mutable_x()->set_raw_data(std::string(2 * 32 * sizeof(float), '\0'));
    change.second(&piece);
    stream->Write(piece);
    stream->WritesDone();
    grpc::Status status = stream->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << change.first << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(change.first));
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub_->BackwardStream(&ctx);
  v1::BackwardRequest head;
  head.set_layer("ffn0");
  head.set_step_id(1);
  *head.mutable_d_out() = FloatsToProto({4, 32}, RandomFloats(4 * 32, 2));
  head.mutable_d_out()->mutable_raw_data()->resize(2 * 32 * sizeof(float));
  ASSERT_TRUE(stream->Write(head));
  v1::BackwardRequest piece;
  piece.mutable_d_out()->set_raw_data(std::string(2 * 32 * sizeof(float), '\0'));
  piece.mutable_d_out()->set_datatype("BF16");
  stream->Write(piece);
  stream->WritesDone();
  grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("d_out.datatype"));
}

// Request bytes that do not parse: Forward and Backward are moed's own raw handlers
// (INVALID_ARGUMENT); every other method is parsed by gRPC's generated callback handler,
// which answers UNIMPLEMENTED with an empty message before moed's code runs
// (server/README.md, "Step lifecycle").
TEST_F(ValidationTest, UnparseableRequestBytes) {
  grpc::GenericStub generic(channel_);
  auto call = [&](const std::string& method) {
    const std::string garbage = "\xff\xff\xff\xff";  // an invalid tag
    grpc::Slice slice(garbage.data(), garbage.size());
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    generic.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      status = s;
      done = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return status;
  };
  for (const char* method : {"/moe.v1.MoeService/Forward", "/moe.v1.MoeService/Backward"}) {
    grpc::Status status = call(method);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << method << ": " << status.error_message();
  }
  grpc::Status status = call("/moe.v1.MoeService/GetLayer");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
  EXPECT_EQ(status.error_message(), "");
}

}  // namespace
}  // namespace moe
