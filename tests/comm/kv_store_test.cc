// Tests of the rendezvous stores: MemoryKeyValueStore and FileKeyValueStore behave alike
// (the same typed tests run on both), plus what only the file store has.
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/comm/file_kv_store.h"
#include "engine/comm/memory_kv_store.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return absl::StrCat(base != nullptr ? base : "/tmp", "/", name, "_", getpid(), "_",
                      absl::ToUnixNanos(absl::Now()));
}

class StoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::shared_ptr<KeyValueStore> MakeStore() {
    if (GetParam() == "memory") return std::make_shared<MemoryKeyValueStore>();
    auto store = FileKeyValueStore::Create(TempDir("kv"));
    EXPECT_TRUE(store.ok()) << store.status();
    return *store;
  }
};

TEST_P(StoreTest, SetThenGet) {
  auto store = MakeStore();
  ASSERT_TRUE(store->Set("rank/0", "addr0").ok());
  auto value = store->Get("rank/0", absl::Seconds(1));
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "addr0");
}

TEST_P(StoreTest, BinaryValuesAndOverwrite) {
  auto store = MakeStore();
  const std::string binary("a\0b\xff\n", 5);
  ASSERT_TRUE(store->Set("k", "first").ok());
  ASSERT_TRUE(store->Set("k", binary).ok());
  auto value = store->Get("k", absl::Seconds(1));
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, binary);
  ASSERT_TRUE(store->Set("empty", "").ok());
  EXPECT_EQ(*store->Get("empty", absl::Seconds(1)), "");
}

TEST_P(StoreTest, GetWaitsForALaterSet) {
  auto store = MakeStore();
  std::thread writer([store] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(store->Set("late", "here").ok());
  });
  const absl::Time start = absl::Now();
  auto value = store->Get("late", absl::Seconds(10));
  writer.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "here");
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(90));
}

TEST_P(StoreTest, MissingKeyTimesOut) {
  auto store = MakeStore();
  const absl::Time start = absl::Now();
  auto value = store->Get("never", absl::Milliseconds(200));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(value.status().code(), absl::StatusCode::kDeadlineExceeded) << value.status();
  EXPECT_GE(waited, absl::Milliseconds(190));
  EXPECT_LT(waited, absl::Seconds(2));
  EXPECT_EQ(store->Get("never", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_P(StoreTest, KeysAreDistinct) {
  auto store = MakeStore();
  // Keys that a naive file mapping would merge or escape the directory with.
  const std::string keys[] = {"a/b", "a_b", "a%2Fb", "../x", ".", "a.b", "a b"};
  for (const std::string& key : keys) ASSERT_TRUE(store->Set(key, "v:" + key).ok()) << key;
  for (const std::string& key : keys) {
    auto value = store->Get(key, absl::Seconds(1));
    ASSERT_TRUE(value.ok()) << key << ": " << value.status();
    EXPECT_EQ(*value, "v:" + key);
  }
}

TEST_P(StoreTest, EmptyKeyIsInvalid) {
  auto store = MakeStore();
  EXPECT_EQ(store->Set("", "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Get("", absl::Seconds(1)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(StoreTest, ManyThreadsPublishAndReadAll) {
  auto store = MakeStore();
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::vector<int> found(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ASSERT_TRUE(store->Set(absl::StrCat("rank/", t), absl::StrCat(t * 7)).ok());
      for (int peer = 0; peer < kThreads; ++peer) {
        auto value = store->Get(absl::StrCat("rank/", peer), absl::Seconds(10));
        if (value.ok() && *value == absl::StrCat(peer * 7)) ++found[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(found[t], kThreads) << "thread " << t;
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreTest, ::testing::Values("memory", "file"),
                         [](const auto& info) { return info.param; });

TEST(FileKeyValueStoreTest, TwoStoresOnOneDirectoryShareKeys) {
  const std::string dir = TempDir("shared");
  auto a = FileKeyValueStore::Create(dir);
  auto b = FileKeyValueStore::Create(dir + "/");
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Set("x", "from a").ok());
  EXPECT_EQ(*(*b)->Get("x", absl::Seconds(1)), "from a");
}

TEST(FileKeyValueStoreTest, CreatesNestedDirectories) {
  const std::string dir = TempDir("nested") + "/one/two";
  auto store = FileKeyValueStore::Create(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Set("k", "v").ok());
}

TEST(FileKeyValueStoreTest, PathThatIsAFileIsAnError) {
  const std::string dir = TempDir("file_not_dir");
  auto store = FileKeyValueStore::Create(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Set("k", "v").ok());
  auto bad = FileKeyValueStore::Create(dir + "/k");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
}

TEST(FileKeyValueStoreTest, EscapeKeyKeepsSafeCharactersOnly) {
  EXPECT_EQ(FileKeyValueStore::EscapeKey("ab_C-9"), "ab_C-9");
  EXPECT_EQ(FileKeyValueStore::EscapeKey("a/b"), "a%2Fb");
  EXPECT_EQ(FileKeyValueStore::EscapeKey(".."), "%2E%2E");
}

}  // namespace
}  // namespace moe
