// Many small layers against moed + 2 real moe-workers (issue 41, item 3): `--max_layers` refuses
// a CreateLayer beyond it with RESOURCE_EXHAUSTED and leaves the cluster serving, and a few
// hundred layers cost the workers no thread each (their communicators share a few Gloo devices,
// engine/comm/gloo_communicator.h): thread counts stay bounded, health stays SERVING, and the
// last layer still answers a Forward.
#include <chrono>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

// The layer of the report: H 8, F 8, E 2.
v1::LayerConfig SmallLayer() {
  v1::LayerConfig config;
  config.set_hidden(8);
  config.set_ffn(8);
  config.set_num_experts(2);
  config.set_top_k(1);
  return config;
}

grpc::Status Create(TestCluster& cluster, const std::string& name) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::CreateLayerRequest request;
  request.set_name(name);
  *request.mutable_config() = SmallLayer();
  v1::CreateLayerResponse response;
  return cluster.stub()->CreateLayer(&ctx, request, &response);
}

grpc::Status Delete(TestCluster& cluster, const std::string& name) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::DeleteLayerRequest request;
  request.set_name(name);
  v1::DeleteLayerResponse response;
  return cluster.stub()->DeleteLayer(&ctx, request, &response);
}

grpc::Status Forward(TestCluster& cluster, const std::string& name) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::ForwardRequest request;
  request.set_layer(name);
  *request.mutable_x() = FloatsToProto({4, 8}, RandomFloats(32, 5));
  v1::ForwardResponse response;
  return cluster.stub()->Forward(&ctx, request, &response);
}

// "Threads:" of /proc/<pid>/status.
int Threads(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(in, line);) {
    absl::string_view rest = line;
    int threads = 0;
    if (absl::ConsumePrefix(&rest, "Threads:") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &threads)) {
      return threads;
    }
  }
  return -1;
}

std::unique_ptr<TestCluster> Start(std::vector<std::string> flags) {
  ClusterOptions options;
  options.workers = 2;
  options.moed_flags = std::move(flags);
  auto cluster = TestCluster::Start(options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? *std::move(cluster) : nullptr;
}

TEST(LayerFleetTest, MaxLayersRefusesTheNextLayer) {
  constexpr int kLimit = 64;
  std::unique_ptr<TestCluster> cluster = Start({absl::StrCat("--max_layers=", kLimit)});
  ASSERT_NE(cluster, nullptr);
  for (int i = 0; i < kLimit; ++i) {
    grpc::Status s = Create(*cluster, absl::StrCat("l", i));
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  grpc::Status s = Create(*cluster, "one-too-many");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--max_layers=64"));
  EXPECT_EQ(Forward(*cluster, "one-too-many").error_code(), grpc::StatusCode::NOT_FOUND);
  // A deleted layer makes room; the cluster serves throughout.
  ASSERT_TRUE(Delete(*cluster, "l0").ok());
  EXPECT_TRUE(Create(*cluster, "one-too-many").ok());
  EXPECT_TRUE(Forward(*cluster, "one-too-many").ok());
  EXPECT_EQ(cluster->Health().value_or("error"), "SERVING");
}

TEST(LayerFleetTest, HundredsOfSmallLayersCostNoThreadEach) {
  constexpr int kLayers = 300;
  std::unique_ptr<TestCluster> cluster = Start({});
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(Create(*cluster, "first").ok());
  int before[2];
  for (int r = 0; r < 2; ++r) before[r] = Threads(cluster->worker_pid(r));
  const absl::Time start = absl::Now();
  for (int i = 0; i < kLayers; ++i) {
    grpc::Status s = Create(*cluster, absl::StrCat("l", i));
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  const absl::Duration took = absl::Now() - start;
  std::printf("%d layers in %s\n", kLayers, absl::FormatDuration(took).c_str());
  for (int r = 0; r < 2; ++r) {
    const int threads = Threads(cluster->worker_pid(r));
    std::printf("worker %d: %d threads with 1 layer, %d with %d\n", r, before[r], threads,
                kLayers + 1);
    // A few Gloo event loops at most (shared), not one per layer.
    EXPECT_LT(threads, before[r] + 8) << "worker " << r;
  }
  EXPECT_EQ(cluster->Health().value_or("error"), "SERVING");
  EXPECT_TRUE(Forward(*cluster, absl::StrCat("l", kLayers - 1)).ok());
  EXPECT_TRUE(Forward(*cluster, "first").ok());
}

}  // namespace
}  // namespace moe
