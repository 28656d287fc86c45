// LayerRegistry (server/layer_registry.h) without a server: create, duplicate, find, delete,
// --max_layers, identity across a re-creation under one name, the durable restore, and
// concurrent creates and finds.
#include "server/layer_registry.h"

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<LayerEntry> NewEntry(LayerRegistry& registry, const std::string& name) {
  auto layer = std::make_shared<LayerEntry>(name, SavedStepLimits{});
  layer->id = registry.NextLayerId();
  return layer;
}

TEST(LayerRegistryTest, AddThenFind) {
  LayerRegistry registry(8);
  auto layer = NewEntry(registry, "moe.0");
  ASSERT_TRUE(registry.Add(layer).ok());
  absl::StatusOr<std::shared_ptr<LayerEntry>> found = registry.Find("moe.0");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, layer);
  EXPECT_TRUE(registry.Lists(layer));
  EXPECT_EQ(registry.size(), 1);
}

TEST(LayerRegistryTest, FindMissingIsNotFoundAndBadNameInvalid) {
  LayerRegistry registry(8);
  absl::StatusOr<std::shared_ptr<LayerEntry>> missing = registry.Find("absent");
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_THAT(missing.status().message(), HasSubstr("layer: no layer named \"absent\""));
  absl::StatusOr<std::shared_ptr<LayerEntry>> bad = registry.Find("no spaces");
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("layer"));
  EXPECT_TRUE(absl::IsInvalidArgument(registry.Find("").status()));
}

TEST(LayerRegistryTest, DuplicateIsAlreadyExistsAndKeepsTheFirst) {
  LayerRegistry registry(8);
  auto first = NewEntry(registry, "a");
  ASSERT_TRUE(registry.Add(first).ok());
  absl::Status again = registry.Add(NewEntry(registry, "a"));
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  EXPECT_THAT(again.message(), HasSubstr("name: a layer named \"a\" exists"));
  EXPECT_EQ(*registry.Find("a"), first);
  EXPECT_EQ(registry.size(), 1);
}

TEST(LayerRegistryTest, RemoveTakesOnlyThatEntryOff) {
  LayerRegistry registry(8);
  auto old_layer = NewEntry(registry, "a");
  ASSERT_TRUE(registry.Add(old_layer).ok());
  ASSERT_TRUE(registry.Remove(old_layer).ok());
  EXPECT_TRUE(absl::IsNotFound(registry.Find("a").status()));
  EXPECT_FALSE(registry.Lists(old_layer));
  absl::Status twice = registry.Remove(old_layer);
  EXPECT_TRUE(absl::IsNotFound(twice)) << twice;
  EXPECT_THAT(twice.message(), HasSubstr("name: no layer named \"a\""));
  // Created again under the same name: the old entry's Remove leaves the new one listed.
  auto new_layer = NewEntry(registry, "a");
  ASSERT_TRUE(registry.Add(new_layer).ok());
  EXPECT_NE(new_layer->id, old_layer->id);
  EXPECT_TRUE(absl::IsNotFound(registry.Remove(old_layer)));
  EXPECT_FALSE(registry.Lists(old_layer));
  EXPECT_TRUE(registry.Lists(new_layer));
  EXPECT_EQ(*registry.Find("a"), new_layer);
}

TEST(LayerRegistryTest, MaxLayersIsResourceExhaustedUntilOneIsRemoved) {
  LayerRegistry registry(2);
  auto a = NewEntry(registry, "a");
  ASSERT_TRUE(registry.Add(a).ok());
  ASSERT_TRUE(registry.Add(NewEntry(registry, "b")).ok());
  absl::Status full = registry.Add(NewEntry(registry, "c"));
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_THAT(full.message(), HasSubstr("2 layers exist, the most --max_layers=2"));
  // A duplicate name is ALREADY_EXISTS even when full.
  EXPECT_TRUE(absl::IsAlreadyExists(registry.Add(NewEntry(registry, "a"))));
  ASSERT_TRUE(registry.Remove(a).ok());
  EXPECT_TRUE(registry.Add(NewEntry(registry, "c")).ok());
  EXPECT_EQ(registry.size(), 2);
}

TEST(LayerRegistryTest, RestoreListsPastTheLimit) {
  LayerRegistry registry(1);
  registry.Restore(NewEntry(registry, "a"));
  registry.Restore(NewEntry(registry, "b"));
  EXPECT_EQ(registry.size(), 2);
  EXPECT_TRUE(registry.Find("b").ok());
}

TEST(LayerRegistryTest, ListAndForEachInNameOrder) {
  LayerRegistry registry(8);
  for (const char* name : {"c", "a", "b"}) ASSERT_TRUE(registry.Add(NewEntry(registry, name)).ok());
  std::vector<std::string> listed;
  for (const auto& layer : registry.List()) listed.push_back(layer->name);
  EXPECT_EQ(listed, (std::vector<std::string>{"a", "b", "c"}));
  std::vector<std::string> visited;
  registry.ForEach([&](LayerEntry& layer) {
    absl::MutexLock lock(&layer.mu);  // an entry's mu may be taken under the registry's lock
    visited.push_back(layer.name);
  });
  EXPECT_EQ(visited, listed);
}

TEST(LayerRegistryTest, IdsAreUnique) {
  LayerRegistry registry(8);
  std::set<uint64_t> ids;
  for (int i = 0; i < 100; ++i) ids.insert(registry.NextLayerId());
  EXPECT_EQ(ids.size(), 100u);
  EXPECT_EQ(ids.count(0), 0u);
}

// Threads create the same names at once: each name is listed exactly once, every Find sees a
// whole entry or NOT_FOUND, and the limit holds.
TEST(LayerRegistryTest, ConcurrentCreateAndFind) {
  constexpr int kThreads = 8;
  constexpr int kNames = 40;
  constexpr int kLimit = 32;
  LayerRegistry registry(kLimit);
  std::atomic<int> created{0}, exists{0}, full{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kNames; ++i) {
        const std::string name = absl::StrCat("layer.", i);
        absl::Status added = registry.Add(NewEntry(registry, name));
        if (added.ok()) {
          ++created;
        } else if (absl::IsAlreadyExists(added)) {
          ++exists;
        } else if (absl::IsResourceExhausted(added)) {
          ++full;
        } else {
          ++other;
        }
        absl::StatusOr<std::shared_ptr<LayerEntry>> found = registry.Find(name);
        if (found.ok() ? (*found)->name != name : !absl::IsNotFound(found.status())) ++other;
        registry.List();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(created.load(), kLimit);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(created + exists + full, kThreads * kNames);
  EXPECT_EQ(registry.size(), kLimit);
  std::set<uint64_t> ids;
  for (const auto& layer : registry.List()) ids.insert(layer->id);
  EXPECT_EQ(ids.size(), static_cast<size_t>(kLimit));
}

}  // namespace
}  // namespace moe
