// Two moe-worker services in one process (threads, real Gloo over an in-memory store, no
// front end): when their CreateLayer calls carry different configs (a front end and workers of
// different versions, or any bug that splits them), both answer FAILED_PRECONDITION before
// any collective whose sizes follow from the config, instead of Gloo aborting the process;
// the same workers then create a layer with equal configs and run a step on it.
#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/comm/memory_kv_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker_service.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

constexpr int kRanks = 2;

class WorkerConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = std::make_shared<MemoryKeyValueStore>();
    EngineOptions engine;
    engine.cpu_threads = 1;
    engine.gloo.hostname = "127.0.0.1";
    for (int r = 0; r < kRanks; ++r) {
      workers_.push_back(std::make_unique<WorkerService>("cpu", store, engine));
    }
    std::vector<grpc::Status> status = OnAllRanks([&](int r) {
      internal::SetupRequest request;
      request.set_generation(1);
      request.set_rank(r);
      request.set_world_size(kRanks);
      request.set_store_prefix("g1/");
      request.set_collective_timeout_ms(20000);
      internal::SetupResponse response;
      return workers_[r]->Setup(nullptr, &request, &response);
    });
    for (const grpc::Status& s : status) ASSERT_TRUE(s.ok()) << s.error_message();
  }

  // Runs fn(rank) on one thread per rank, as the front end's parallel fan-out does.
  std::vector<grpc::Status> OnAllRanks(const std::function<grpc::Status(int)>& fn) {
    std::vector<grpc::Status> status(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { status[r] = fn(r); });
    for (auto& t : threads) t.join();
    return status;
  }

  std::vector<grpc::Status> CreateLayer(uint64_t id, const std::vector<v1::LayerConfig>& configs) {
    return OnAllRanks([&](int r) {
      internal::WorkerCreateLayerRequest request;
      request.set_generation(1);
      request.set_layer_id(id);
      request.set_name("l");
      *request.mutable_config() = configs[r];
      internal::WorkerCreateLayerResponse response;
      return workers_[r]->CreateLayer(nullptr, &request, &response);
    });
  }

  std::vector<std::unique_ptr<WorkerService>> workers_;
};

TEST_F(WorkerConfigTest, DifferentConfigsFailOnEveryRank) {
  v1::LayerConfig other = TinyConfig(/*seed=*/1);
  other.set_num_experts(4);  // the count all-gather would differ in size
  std::vector<grpc::Status> status = CreateLayer(1, {TinyConfig(1), other});
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(status[r].error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "rank " << r << ": " << status[r].error_message();
    EXPECT_THAT(status[r].error_message(), ::testing::HasSubstr("config differs"));
  }
  // A coefficient only (no size differs): still refused.
  other = TinyConfig(1);
  other.set_z_loss_coeff(0.5);
  status = CreateLayer(2, {TinyConfig(1), other});
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(status[r].error_code(), grpc::StatusCode::FAILED_PRECONDITION) << "rank " << r;
  }

  // The workers are fine: equal configs create a layer, and a step runs on it.
  status = CreateLayer(3, {TinyConfig(1), TinyConfig(1)});
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(status[r].ok()) << status[r].error_message();
  status = OnAllRanks([&](int r) {
    internal::WorkerForwardRequest request;
    request.set_generation(1);
    request.set_layer_id(3);
    *request.mutable_x() = FloatsToProto({4, 32}, RandomFloats(4 * 32, 10 + r));
    internal::WorkerForwardResponse response;
    grpc::Status s = workers_[r]->Forward(nullptr, &request, &response);
    if (s.ok() && response.out().shape_size() != 2) return grpc::Status(grpc::INTERNAL, "shape");
    return s;
  });
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(status[r].ok()) << status[r].error_message();
}

// A generation whose set-up was superseded before the front end re-created the layers (a
// worker re-joined meanwhile, or a re-creation failed part-way) must not cost the layers
// their trained state: the instances of the last generation that held them stay restorable
// through any number of such generations, and are dropped by CreateLayer or DeleteLayer.
TEST_F(WorkerConfigTest, LayersStayRestorableAcrossSupersededGenerations) {
  std::vector<grpc::Status> status = CreateLayer(7, {TinyConfig(1), TinyConfig(1)});
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(status[r].ok()) << status[r].error_message();
  status = CreateLayer(8, {TinyConfig(2), TinyConfig(2)});
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(status[r].ok()) << status[r].error_message();
  for (int generation : {2, 3}) {  // both set up, neither re-creates the layers
    status = OnAllRanks([&](int r) {
      internal::SetupRequest request;
      request.set_generation(generation);
      request.set_rank(r);
      request.set_world_size(kRanks);
      request.set_store_prefix(absl::StrCat("g", generation, "/"));
      request.set_collective_timeout_ms(20000);
      internal::SetupResponse response;
      return workers_[r]->Setup(nullptr, &request, &response);
    });
    for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(status[r].ok()) << status[r].error_message();
  }
  for (int r = 0; r < kRanks; ++r) {
    internal::PingResponse pong;
    ASSERT_TRUE(workers_[r]->Ping(nullptr, nullptr, &pong).ok());
    EXPECT_THAT(pong.restorable_layers(), ::testing::UnorderedElementsAre(7, 8)) << "rank " << r;
  }
  status = OnAllRanks([&](int r) {
    internal::WorkerCreateLayerRequest request;
    request.set_generation(3);
    request.set_layer_id(7);
    request.set_name("l");
    request.set_restore(true);
    *request.mutable_config() = TinyConfig(1);
    internal::WorkerCreateLayerResponse response;
    grpc::Status s = workers_[r]->CreateLayer(nullptr, &request, &response);
    if (s.ok() && !response.restored()) return grpc::Status(grpc::INTERNAL, "not restored");
    return s;
  });
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(status[r].ok()) << status[r].error_message();
  for (int r = 0; r < kRanks; ++r) {  // a layer the front end no longer knows is dropped
    internal::WorkerLayerRequest request;
    request.set_generation(3);
    request.set_layer_id(8);
    internal::WorkerEmpty empty;
    ASSERT_TRUE(workers_[r]->DeleteLayer(nullptr, &request, &empty).ok());
    internal::PingResponse pong;
    ASSERT_TRUE(workers_[r]->Ping(nullptr, nullptr, &pong).ok());
    EXPECT_EQ(pong.restorable_layers_size(), 0) << "rank " << r;
  }
}

// Threads of this process right now.
int ThreadCount() {
  int n = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent* entry = readdir(dir)) n += entry->d_name[0] != '.';
    closedir(dir);
  }
  return n;
}

// The workers here run with cpu_threads=1 (moed gives each local worker its share of the
// cores): a layer's kernels must then run on the calling thread only. Each layer's backend
// used to be made with the default (one thread per hardware thread), ignoring --cpu_threads.
TEST_F(WorkerConfigTest, LayerKernelsHonourCpuThreads) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one hardware thread";
  std::vector<grpc::Status> status = CreateLayer(4, {TinyConfig(1), TinyConfig(1)});
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(status[r].ok()) << status[r].error_message();
  auto forward = [&] {
    return OnAllRanks([&](int r) {
      internal::WorkerForwardRequest request;
      request.set_generation(1);
      request.set_layer_id(4);
      *request.mutable_x() = FloatsToProto({8192, 32}, RandomFloats(8192 * 32, 20 + r));
      internal::WorkerForwardResponse response;
      return workers_[r]->Forward(nullptr, &request, &response);
    });
  };
  forward();  // warm-up: lazily started library threads are part of the baseline
  std::atomic<bool> done{false};
  std::atomic<int> peak{0};
  std::thread sampler([&] {
    while (!done) peak = std::max(peak.load(), ThreadCount());
  });
  absl::SleepFor(absl::Milliseconds(20));
  const int baseline = ThreadCount();  // this thread, the sampler, the library's threads
  for (int i = 0; i < 5; ++i) {
    status = forward();
    for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(status[r].ok()) << status[r].error_message();
  }
  done = true;
  sampler.join();
  EXPECT_LE(peak.load(), baseline + kRanks) << "kernel threads beyond the one per rank";
}

}  // namespace
}  // namespace moe
