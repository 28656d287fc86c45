// WorkerMemoryAdmission: admission control's budget, held bytes and refusals, without a
// server (server/worker_memory_admission.h). The service-level checks (CreateLayer, Forward
// and Backward refused on a cluster) are admission_test and overload_test.
#include "server/worker_memory_admission.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "server/step_memory.h"
#include "tests/engine/tiny_config.h"

namespace moe {
namespace {

using Reservation = WorkerMemoryReservations::Reservation;

v1::WorkerStatus Worker(const std::string& address, const std::string& device,
                        int64_t capacity) {
  v1::WorkerStatus w;
  w.set_address(address);
  w.set_device(device);
  w.set_memory_capacity_bytes(capacity);
  return w;
}

// Books that a test fills in: the workers' statuses, the reported fraction, the layers.
struct FakeBooks {
  std::vector<v1::WorkerStatus> workers;
  std::optional<double> fraction;
  std::vector<std::pair<LayerConfig, int64_t>> layers;  // config, kept steps' bytes

  WorkerMemoryAdmission::Books Make() {
    WorkerMemoryAdmission::Books books;
    books.worker_statuses = [this] { return workers; };
    books.reported_deferred_wgrad_fraction = [this] { return fraction; };
    books.for_each_layer = [this](const WorkerMemoryAdmission::LayerVisitor& visit) {
      for (const auto& layer : layers) visit(layer.first, layer.second);
    };
    return books;
  }
};

TEST(WorkerMemoryAdmissionTest, BudgetExplicitOffOrDerived) {
  FakeBooks books;
  bool derived = true;
  EXPECT_EQ(WorkerMemoryAdmission(1000, 2, books.Make()).Budget(&derived), 1000);
  EXPECT_FALSE(derived);
  EXPECT_EQ(WorkerMemoryAdmission(-1, 2, books.Make()).Budget(&derived), 0);
  EXPECT_FALSE(derived);
  // Derived, nothing reported yet: no admission control.
  WorkerMemoryAdmission admission(0, 2, books.Make());
  EXPECT_EQ(admission.Budget(&derived), 0);
  EXPECT_TRUE(derived);
  EXPECT_TRUE(admission.Admit("Forward", "l", 10, int64_t{1} << 60).ok());
  // Two CPU workers share host a (80% / 2 each), a GPU worker 90%: the smallest share wins.
  books.workers = {Worker("a:1", "cpu", 1000), Worker("a:2", "cpu", 1000),
                   Worker("b:1", "cuda:0", 1000), Worker("c:1", "cpu", 0)};
  EXPECT_EQ(admission.Budget(&derived), 400);
  EXPECT_TRUE(derived);
  books.workers = {Worker("b:1", "cuda:0", 1000), Worker("b:2", "cuda:1", 2000)};
  EXPECT_EQ(admission.Budget(&derived), 900);
}

TEST(WorkerMemoryAdmissionTest, HeldBytesCountLayersAndKeptSteps) {
  FakeBooks books;
  WorkerMemoryAdmission admission(int64_t{1} << 40, 2, books.Make());
  EXPECT_EQ(admission.DeferredWgradFraction(), kDefaultDeferredWgradFraction);
  books.fraction = 0.5;
  EXPECT_EQ(admission.DeferredWgradFraction(), 0.5);
  const LayerConfig config = TinyLayerConfig();
  const int64_t shard = LayerBytesPerWorker(config, 2, 0.5);
  // Kept steps' bytes are summed over the workers: per worker, divided and rounded up.
  EXPECT_EQ(admission.LayerHeldBytes(config, 0, 0.5), shard);
  EXPECT_EQ(admission.LayerHeldBytes(config, 7, 0.5), shard + 4);
  EXPECT_EQ(admission.HeldBytes(), 0);
  books.layers = {{config, 7}, {config, 100}};
  EXPECT_EQ(admission.HeldBytes(), 2 * shard + 4 + 50);
}

TEST(WorkerMemoryAdmissionTest, RefusalNamesTheFiguresAndTheFlag) {
  FakeBooks books;
  books.layers = {{TinyLayerConfig(), 0}};
  const int64_t held = WorkerMemoryAdmission(1, 2, books.Make()).HeldBytes();
  ASSERT_GT(held, 0);
  WorkerMemoryAdmission admission(held + 100, 2, books.Make());
  EXPECT_TRUE(admission.Admit("Forward", "l", 10, 100).ok());
  const absl::Status refused = admission.Admit("Forward", "l", 10, 101);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("Forward of 10 tokens on layer \"l\" needs an estimated 101"),
            absl::string_view::npos)
      << refused;
  EXPECT_NE(refused.message().find("--worker_memory_bytes"), absl::string_view::npos);
  EXPECT_EQ(refused.message().find("derived"), absl::string_view::npos);
  const absl::Status create = admission.Admit("CreateLayer", "m", -1, 1000);
  EXPECT_NE(create.message().find("CreateLayer of layer \"m\" needs"), absl::string_view::npos)
      << create;
}

TEST(WorkerMemoryAdmissionTest, RunningCallsAreSummed) {
  FakeBooks books;
  WorkerMemoryAdmission admission(100, 2, books.Make());
  Reservation first, second;
  ASSERT_TRUE(admission.Admit("Forward", "a", 1, 60, &first).ok());
  EXPECT_EQ(admission.reserved(), 60);
  // Alone it fits; beside the running call it does not.
  EXPECT_TRUE(admission.Admit("Forward", "b", 1, 60).ok());
  const absl::Status refused = admission.Admit("Forward", "b", 1, 60, &second);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("reserve 60 more"), absl::string_view::npos) << refused;
  EXPECT_NE(refused.message().find("retry once the running calls ended"),
            absl::string_view::npos);
  EXPECT_EQ(second.bytes(), 0);
  first.Release();
  EXPECT_TRUE(admission.Admit("Forward", "b", 1, 60, &second).ok());
  EXPECT_EQ(admission.reserved(), 60);
}

TEST(WorkerMemoryAdmissionTest, LeavingLayerStaysReserved) {
  FakeBooks books;
  const LayerConfig config = TinyLayerConfig();
  WorkerMemoryAdmission admission(int64_t{1} << 40, 2, books.Make());
  {
    const Reservation leaving = admission.HoldLeavingLayer(config, 10);
    EXPECT_EQ(admission.reserved(),
              admission.LayerHeldBytes(config, 10, admission.DeferredWgradFraction()));
  }
  EXPECT_EQ(admission.reserved(), 0);
}

}  // namespace
}  // namespace moe
