// The front end alone, with no worker ever joining: every request is validated before any
// worker is involved, so a bad request gets its own code (not UNAVAILABLE), a valid one that
// needs the workers gets UNAVAILABLE, and the read-only RPCs work.
#include <grpcpp/grpcpp.h>

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

}  // namespace
}  // namespace moe
