// The fixture of the tests that run the front end alone: a MoeServiceImpl on a free loopback
// port whose WorkerPool (world size 2) is never started, so no worker ever joins, and a stub
// to call it.
//
//   class ValidationTest : public FrontEndTest {
//    protected:
//     void SetUp() override { StartFrontEnd(ServiceOptions{}); }
//   };
#ifndef MOED_TESTS_SERVER_FRONTEND_FIXTURE_H_
#define MOED_TESTS_SERVER_FRONTEND_FIXTURE_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "server/cluster_secret.h"
#include "server/metrics.h"
#include "server/moe_service.h"
#include "server/worker_pool.h"

namespace moe {

class FrontEndTest : public ::testing::Test {
 protected:
  // Starts the service with `options` (auth_, when a test set it, outlives the service).
  // Fatal when the port cannot be bound: call it from SetUp.
  void StartFrontEnd(const ServiceOptions& options) {
    WorkerPoolOptions pool_options;
    pool_options.world_size = 2;
    pool_ = std::make_unique<WorkerPool>(  // never started: nobody joins
        pool_options, *ClusterSecret::Generate());
    service_ = std::make_unique<MoeServiceImpl>(options, pool_.get(), &metrics_);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    stub_ = v1::MoeService::NewStub(channel_);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  Metrics metrics_;
  std::unique_ptr<TokenAuthenticator> auth_;  // null: no tokens file
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<MoeServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::MoeService::Stub> stub_;
};

}  // namespace moe

#endif  // MOED_TESTS_SERVER_FRONTEND_FIXTURE_H_
