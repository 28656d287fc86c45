// DurableSchedule (server/durable_schedule.h) without a server or workers: which changes make
// a durable checkpoint due (forced, every N optimizer steps, every D with something changed),
// none without a store, and the books after a save and a load.
#include "server/durable_schedule.h"

#include <cstdlib>
#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace moe {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000000);

class DurableScheduleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    absl::StatusOr<std::unique_ptr<DurableStore>> store =
        DurableStore::Open(std::string(tmp != nullptr ? tmp : "/tmp") + "/durable_schedule");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    absl::MutexLock lock(&layer_.mu);
    layer_.durable_since = kT0;
  }
  std::unique_ptr<DurableStore> store_;
  LayerEntry layer_{"a", SavedStepLimits{}};
};

TEST_F(DurableScheduleTest, NoStoreNeverDueButCountsSteps) {
  const DurableSchedule schedule(nullptr, 1, absl::Seconds(1));
  EXPECT_FALSE(schedule.AfterChange(layer_, /*optimizer_step=*/true, /*force=*/true, kT0));
  EXPECT_FALSE(schedule.AfterChange(layer_, false, true, kT0 + absl::Hours(1)));
  absl::MutexLock lock(&layer_.mu);
  EXPECT_EQ(layer_.optimizer_step, 1);
  EXPECT_FALSE(layer_.changed_since_durable);
}

TEST_F(DurableScheduleTest, ForcedIsDue) {
  const DurableSchedule schedule(store_.get(), 0, absl::ZeroDuration());
  EXPECT_FALSE(schedule.AfterChange(layer_, false, /*force=*/false, kT0));
  EXPECT_TRUE(schedule.AfterChange(layer_, false, /*force=*/true, kT0));
}

TEST_F(DurableScheduleTest, EveryNOptimizerSteps) {
  const DurableSchedule schedule(store_.get(), 3, absl::ZeroDuration());
  EXPECT_FALSE(schedule.AfterChange(layer_, true, false, kT0));
  EXPECT_FALSE(schedule.AfterChange(layer_, true, false, kT0));
  EXPECT_TRUE(schedule.AfterChange(layer_, true, false, kT0));  // 3 since the durable 0
  DurableLayer record;
  record.incarnation = 1;
  record.optimizer_step = 3;
  DurableSchedule::RecordSaved(layer_, record, kT0);
  EXPECT_FALSE(schedule.AfterChange(layer_, true, false, kT0));
  EXPECT_FALSE(schedule.AfterChange(layer_, true, false, kT0));
  EXPECT_TRUE(schedule.AfterChange(layer_, true, false, kT0));
}

TEST_F(DurableScheduleTest, EveryDurationOnlyWithSomethingChanged) {
  const DurableSchedule schedule(store_.get(), 0, absl::Minutes(5));
  DurableSchedule::RecordSaved(layer_, DurableLayer{}, kT0);
  // A change before the period ends: not yet.
  EXPECT_FALSE(schedule.AfterChange(layer_, false, false, kT0 + absl::Minutes(4)));
  EXPECT_TRUE(schedule.AfterChange(layer_, false, false, kT0 + absl::Minutes(5)));
  // Saved: nothing changed since, so an optimizer step past the period is due (it changed
  // the step), but only once the period passed again.
  DurableSchedule::RecordSaved(layer_, DurableLayer{}, kT0 + absl::Minutes(5));
  {
    absl::MutexLock lock(&layer_.mu);
    EXPECT_FALSE(layer_.changed_since_durable);
    layer_.optimizer_step = 0;
  }
  EXPECT_FALSE(schedule.AfterChange(layer_, true, false, kT0 + absl::Minutes(6)));
  EXPECT_TRUE(schedule.AfterChange(layer_, true, false, kT0 + absl::Minutes(10)));
}

TEST_F(DurableScheduleTest, RecordLoadedTakesTheRecordsStep) {
  {
    absl::MutexLock lock(&layer_.mu);
    layer_.optimizer_step = 9;
    layer_.changed_since_durable = true;
    layer_.load_durable = true;
  }
  DurableLayer record;
  record.optimizer_step = 4;
  DurableSchedule::RecordLoaded(layer_, record, kT0 + absl::Seconds(7));
  absl::MutexLock lock(&layer_.mu);
  EXPECT_EQ(layer_.optimizer_step, 4);
  EXPECT_FALSE(layer_.changed_since_durable);
  EXPECT_FALSE(layer_.load_durable);
  EXPECT_EQ(layer_.durable_since, kT0 + absl::Seconds(7));
}

}  // namespace
}  // namespace moe
