// The Coordinator's rendezvous store: its bounds on bytes and keys (RESOURCE_EXHAUSTED naming
// the flag), keys of earlier generations dropped when a new one forms, keys outside
// "g<generation>/" refused, and waiting reads bounded per caller and in total.
#include "server/rendezvous_store.h"

#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<std::string> Get(RendezvousStore& store, const std::string& key,
                                absl::Duration timeout, const std::string& caller = "a") {
  return store.Get(key, timeout, caller, [] { return false; });
}

TEST(RendezvousStoreTest, BytesAndKeysAreBounded) {
  RendezvousLimits limits;
  limits.max_bytes = 1000;
  limits.max_keys = 3;
  RendezvousStore store(limits);
  absl::Status s = store.Set("g1/big", std::string(2000, 'x'));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("--rendezvous_max_bytes=1000"));
  ASSERT_TRUE(store.Set("g1/a", std::string(100, 'x')).ok());
  ASSERT_TRUE(store.Set("g1/a", std::string(900, 'x')).ok());  // replaces: 904 bytes
  EXPECT_EQ(store.bytes(), 904);
  EXPECT_EQ(store.Set("g1/b", std::string(100, 'x')).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(store.Set("g1/a", "1").ok());
  ASSERT_TRUE(store.Set("g1/b", "2").ok());
  ASSERT_TRUE(store.Set("g1/c", "3").ok());
  s = store.Set("g1/d", "4");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("--rendezvous_max_keys=3"));
  EXPECT_TRUE(store.Set("g1/c", "overwrite").ok());  // not a new key
}

TEST(RendezvousStoreTest, KeysOutsideAGenerationAreRefused) {
  RendezvousStore store(RendezvousLimits{});
  for (const char* key : {"", "junk", "g/x", "gx/y", "g-1/x", "1/x"}) {
    EXPECT_EQ(store.Set(key, "v").code(), absl::StatusCode::kInvalidArgument) << key;
    EXPECT_EQ(Get(store, key, absl::Seconds(10)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << key;
  }
  EXPECT_EQ(store.keys(), 0);
}

TEST(RendezvousStoreTest, EarlierGenerationsAreDropped) {
  RendezvousStore store(RendezvousLimits{});
  ASSERT_TRUE(store.Set("g1/world/rank_0", "a").ok());
  ASSERT_TRUE(store.Set("g2/world/rank_0", "b").ok());
  ASSERT_TRUE(store.Set("g12/layer/1/rank_0", "c").ok());
  store.DropGenerationsBefore(2);
  EXPECT_EQ(store.keys(), 2);
  EXPECT_EQ(store.bytes(), 15 + 1 + 18 + 1);
  EXPECT_EQ(Get(store, "g1/world/rank_0", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::Status late = store.Set("g1/world/rank_1", "late");
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
  store.DropGenerationsBefore(13);
  EXPECT_EQ(store.keys(), 0);
  EXPECT_EQ(store.bytes(), 0);
}

TEST(RendezvousStoreTest, WaitingReadsAreBoundedAndEnd) {
  RendezvousLimits limits;
  limits.max_waiting = 3;
  limits.max_waiting_per_caller = 2;
  RendezvousStore store(limits);
  std::vector<std::thread> waiters;
  std::vector<absl::StatusOr<std::string>> got(3);
  waiters.emplace_back([&] { got[0] = Get(store, "g1/k", absl::Seconds(60), "a"); });
  waiters.emplace_back([&] { got[1] = Get(store, "g1/k", absl::Seconds(60), "a"); });
  waiters.emplace_back([&] { got[2] = Get(store, "g1/k", absl::Seconds(60), "b"); });
  absl::SleepFor(absl::Milliseconds(300));
  absl::StatusOr<std::string> refused = Get(store, "g1/k", absl::Seconds(60), "c");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("--rendezvous_max_waiting=3"));
  ASSERT_TRUE(store.Set("g1/k", "v").ok());
  for (std::thread& t : waiters) t.join();
  for (const auto& g : got) EXPECT_EQ(g.value_or("error"), "v");
  // The bounds count waiting reads only: all are free again.
  std::vector<std::thread> more;
  std::vector<absl::StatusOr<std::string>> again(2);
  more.emplace_back([&] { again[0] = Get(store, "g1/j", absl::Seconds(60), "a"); });
  more.emplace_back([&] { again[1] = Get(store, "g1/j", absl::Seconds(60), "a"); });
  absl::SleepFor(absl::Milliseconds(300));
  refused = Get(store, "g1/j", absl::Seconds(60), "a");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("--rendezvous_max_waiting_per_caller=2"));
  ASSERT_TRUE(store.Set("g1/j", "w").ok());
  for (std::thread& t : more) t.join();
  for (const auto& g : again) EXPECT_EQ(g.value_or("error"), "w");
  // A cancelled read ends within a slice, long before its timeout.
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> cancelled =
      store.Get("g1/never", absl::Seconds(60), "a", [] { return true; });
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace moe
