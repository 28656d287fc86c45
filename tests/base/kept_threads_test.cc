// KeptThreads (base/kept_threads.h): every index runs exactly once per Run, concurrently, and
// threads are kept between runs instead of started anew; several callers at once each get
// their lanes.
#include "base/kept_threads.h"

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(KeptThreads, RunsEveryLaneOnceAndKeepsItsThreads) {
  KeptThreads threads;
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> runs(8);
    absl::Mutex mu;
    std::set<std::thread::id> ids;
    threads.Run(8, [&](size_t lane) {
      runs[lane].fetch_add(1);
      absl::MutexLock lock(&mu);
      ids.insert(std::this_thread::get_id());
    });
    for (size_t lane = 0; lane < runs.size(); ++lane) {
      EXPECT_EQ(runs[lane].load(), 1) << "round " << round << " lane " << lane;
    }
    EXPECT_EQ(ids.count(std::this_thread::get_id()), 1u) << "lane 0 runs on the caller";
  }
  // Seven lanes besides the caller's: at most seven threads, whatever the number of rounds.
  EXPECT_LE(threads.ThreadCount(), 7u);
  EXPECT_GE(threads.ThreadCount(), 1u);
  threads.Run(0, [](size_t) { ADD_FAILURE() << "no lane to run"; });
  threads.Run(1, [](size_t lane) { EXPECT_EQ(lane, 0u); });
}

TEST(KeptThreads, LanesRunConcurrently) {
  // All four lanes must be in flight at once to pass the barrier; run one after the other,
  // this would hang (the test's timeout fails it).
  KeptThreads threads;
  for (int round = 0; round < 5; ++round) {
    absl::Barrier* barrier = new absl::Barrier(4);  // deleted by the last one through
    threads.Run(4, [&](size_t) {
      if (barrier->Block()) delete barrier;
    });
  }
  EXPECT_LE(threads.ThreadCount(), 3u);
}

TEST(KeptThreads, SeveralCallersAtOnce) {
  KeptThreads threads;
  constexpr int kCallers = 4, kLanes = 3, kRounds = 40;
  std::atomic<int> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < kRounds; ++r) {
        std::vector<std::atomic<int>> runs(kLanes);
        threads.Run(kLanes, [&](size_t lane) {
          runs[lane].fetch_add(1);
          total.fetch_add(1);
        });
        for (auto& n : runs) EXPECT_EQ(n.load(), 1);
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(total.load(), kCallers * kLanes * kRounds);
  // At most every caller's two extra lanes at once.
  EXPECT_LE(threads.ThreadCount(), static_cast<size_t>(kCallers * (kLanes - 1)));
}

}  // namespace
}  // namespace moe
