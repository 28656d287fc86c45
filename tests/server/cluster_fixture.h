// The shared fixture of the cluster tests: one moed (--max_saved_steps=3,
// --max_layer_bytes=256 MiB, metrics on a free port) with 2 real moe-worker processes per test
// binary, and small helpers for the RPCs the tests use.
#ifndef MOED_TESTS_SERVER_CLUSTER_FIXTURE_H_
#define MOED_TESTS_SERVER_CLUSTER_FIXTURE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {

inline int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

class ClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    metrics_port_ = FreePort();
    ClusterOptions options;
    options.workers = 2;
    // --max_layer_bytes: fuzzed configs must not make the workers allocate gigabytes.
    options.moed_flags = {"--max_saved_steps=3", "--max_layer_bytes=268435456",
                          absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port_)};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  v1::MoeService::Stub* stub() { return cluster_->stub(); }

  grpc::Status Create(const std::string& name, const v1::LayerConfig& config) {
    grpc::ClientContext ctx;
    v1::CreateLayerRequest request;
    request.set_name(name);
    *request.mutable_config() = config;
    v1::CreateLayerResponse response;
    return stub()->CreateLayer(&ctx, request, &response);
  }
  grpc::Status Forward(const std::string& layer, const v1::Tensor& x, bool keep,
                       v1::ForwardResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ForwardRequest request;
    request.set_layer(layer);
    *request.mutable_x() = x;
    request.set_keep_for_backward(keep);
    return stub()->Forward(&ctx, request, response);
  }
  grpc::Status Backward(const std::string& layer, uint64_t step, const v1::Tensor& d_out,
                        v1::BackwardResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::BackwardRequest request;
    request.set_layer(layer);
    request.set_step_id(step);
    *request.mutable_d_out() = d_out;
    return stub()->Backward(&ctx, request, response);
  }
  std::map<std::string, std::vector<float>> Weights(const std::string& layer, bool gradients,
                                                    int64_t chunk_bytes = 0) {
    grpc::ClientContext ctx;
    grpc::Status status;
    std::map<std::string, std::vector<float>> out;
    if (gradients) {
      v1::GetGradientsRequest request;
      request.set_layer(layer);
      request.set_max_chunk_bytes(chunk_bytes);
      auto reader = stub()->GetGradients(&ctx, request);
      out = ReadChunks(reader.get(), &status);
    } else {
      v1::GetWeightsRequest request;
      request.set_layer(layer);
      request.set_max_chunk_bytes(chunk_bytes);
      auto reader = stub()->GetWeights(&ctx, request);
      out = ReadChunks(reader.get(), &status);
    }
    EXPECT_TRUE(status.ok()) << status.error_message();
    return out;
  }

  static inline TestCluster* cluster_ = nullptr;
  static inline int metrics_port_ = 0;
};

// A cluster of its own per test, started with the test's moed flags (2 workers), for tests
// that change moed's limits or break the cluster; and the calls they share.
class OwnClusterTest : public ::testing::Test {
 protected:
  void StartCluster(std::vector<std::string> flags) {
    ClusterOptions options;
    options.moed_flags = std::move(flags);
    StartClusterWith(options);
  }
  void StartClusterWith(const ClusterOptions& options) {
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
  }
  grpc::Status Create(const std::string& name, const v1::LayerConfig& config,
                      absl::Duration deadline = absl::Seconds(60)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::CreateLayerRequest request;
    request.set_name(name);
    *request.mutable_config() = config;
    v1::CreateLayerResponse response;
    return cluster_->stub()->CreateLayer(&ctx, request, &response);
  }
  v1::GetStatusResponse Status() {
    grpc::ClientContext ctx;
    v1::GetStatusResponse status;
    EXPECT_TRUE(cluster_->stub()->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
    return status;
  }

  std::unique_ptr<TestCluster> cluster_;
};

}  // namespace moe

#endif  // MOED_TESTS_SERVER_CLUSTER_FIXTURE_H_
