// SavedSteps: the per-layer books of saved steps, without a server (server/saved_steps.h).
#include "server/saved_steps.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1000000);

SavedStep Step(int64_t tokens, int64_t bytes, absl::Time at = kT0) {
  return SavedStep{tokens, DType::kBFloat16, bytes, at};
}

TEST(SavedStepsTest, AddFindRemoveKeepCountAndBytes) {
  SavedSteps saved("ffn0", {});
  saved.Add(1, Step(8, 100));
  saved.Add(2, Step(4, 50));
  EXPECT_EQ(saved.count(), 2);
  EXPECT_EQ(saved.bytes(), 150);
  absl::StatusOr<SavedStep> found = saved.Find(1, /*issued=*/true);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->tokens, 8);
  EXPECT_EQ(found->dtype, DType::kBFloat16);
  EXPECT_TRUE(saved.Remove(1));
  EXPECT_FALSE(saved.Remove(1));  // already gone
  EXPECT_EQ(saved.count(), 1);
  EXPECT_EQ(saved.bytes(), 50);
  saved.Clear();
  EXPECT_EQ(saved.count(), 0);
  EXPECT_EQ(saved.bytes(), 0);
}

TEST(SavedStepsTest, FindSaysWhyAStepIsNotHeld) {
  SavedSteps saved("ffn0", {});
  absl::StatusOr<SavedStep> released = saved.Find(7, /*issued=*/true);
  EXPECT_EQ(released.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(released.status().message(), HasSubstr("is not held by layer \"ffn0\""));
  absl::StatusOr<SavedStep> never = saved.Find(7, /*issued=*/false);
  EXPECT_EQ(never.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(never.status().message(), HasSubstr("was never issued"));
}

TEST(SavedStepsTest, CheckRoomNamesTheFlagOfTheLimitReached) {
  SavedStepLimits limits;
  limits.max_steps = 2;
  limits.max_bytes = 1000;
  SavedSteps saved("ffn0", limits);
  EXPECT_TRUE(saved.CheckRoom().ok());
  saved.Add(1, Step(1, 10));
  saved.Add(2, Step(1, 10));
  absl::Status full = saved.CheckRoom();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("--max_saved_steps=2"));
  saved.Remove(1);
  saved.Remove(2);
  saved.Add(3, Step(1, 1000));  // exactly at max_bytes: no room for another, but it fits
  EXPECT_TRUE(saved.CheckBytes(1000).ok());
  absl::Status bytes = saved.CheckRoom();
  EXPECT_EQ(bytes.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(bytes.message(), HasSubstr("--max_saved_bytes=1000"));
}

TEST(SavedStepsTest, CheckBytesRefusesAStepThatTakesTheTotalPastTheLimit) {
  SavedStepLimits limits;
  limits.max_bytes = 100;
  SavedSteps saved("ffn0", limits);
  saved.Add(1, Step(1, 60));
  saved.Add(2, Step(1, 60));
  absl::Status over = saved.CheckBytes(60);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("this step needs 60 bytes"));
  EXPECT_THAT(over.message(), HasSubstr("would hold 120 bytes"));
  saved.Remove(2);
  EXPECT_TRUE(saved.CheckBytes(60).ok());
}

TEST(SavedStepsTest, ExpireDropsStepsPastTheTtlAndFindSaysTheyExpired) {
  SavedStepLimits limits;
  limits.ttl = absl::Seconds(10);
  SavedSteps saved("ffn0", limits);
  saved.Add(1, Step(1, 10, kT0));
  saved.Add(2, Step(1, 20, kT0 + absl::Seconds(5)));
  EXPECT_FALSE(saved.AnyDue(kT0 + absl::Seconds(9)));
  EXPECT_TRUE(saved.AnyDue(kT0 + absl::Seconds(10)));  // saved exactly ttl ago: due
  EXPECT_THAT(saved.Expire(kT0 + absl::Seconds(10)), ElementsAre(1));
  EXPECT_EQ(saved.count(), 1);
  EXPECT_EQ(saved.bytes(), 20);
  absl::StatusOr<SavedStep> expired = saved.Find(1, /*issued=*/true);
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(expired.status().message(), HasSubstr("expired"));
  EXPECT_THAT(expired.status().message(), HasSubstr("--saved_step_ttl_s"));
  EXPECT_THAT(saved.Expire(kT0 + absl::Hours(1)), ElementsAre(2));
  EXPECT_EQ(saved.bytes(), 0);
}

TEST(SavedStepsTest, ZeroTtlNeverExpires) {
  SavedStepLimits limits;
  limits.ttl = absl::ZeroDuration();
  SavedSteps saved("ffn0", limits);
  saved.Add(1, Step(1, 10, kT0));
  EXPECT_FALSE(saved.AnyDue(kT0 + absl::Hours(100)));
  EXPECT_TRUE(saved.Expire(kT0 + absl::Hours(100)).empty());
  EXPECT_EQ(saved.count(), 1);
}

TEST(SavedStepsTest, RemembersOnlyTheLatestExpiredIds) {
  SavedStepLimits limits;
  limits.ttl = absl::Seconds(1);
  SavedSteps saved("ffn0", limits);
  const uint64_t total = SavedSteps::kExpiredKept + 10;
  for (uint64_t id = 1; id <= total; ++id) saved.Add(id, Step(1, 1, kT0));
  EXPECT_EQ(saved.Expire(kT0 + absl::Seconds(2)).size(), total);
  EXPECT_THAT(saved.Find(1, true).status().message(), HasSubstr("is not held"));
  EXPECT_THAT(saved.Find(total, true).status().message(), HasSubstr("expired"));
}

}  // namespace
}  // namespace moe
