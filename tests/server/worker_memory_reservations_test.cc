// WorkerMemoryReservations: admission control's in-flight reservations, without a server
// (server/worker_memory_reservations.h).
#include "server/worker_memory_reservations.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace moe {
namespace {

using Reservation = WorkerMemoryReservations::Reservation;

// TryReserve with a fixed `held`.
bool Reserve(WorkerMemoryReservations& r, int64_t need, int64_t budget, int64_t held,
             Reservation* out, int64_t* reserved_seen = nullptr) {
  int64_t held_seen = 0, reserved = 0;
  const bool ok = r.TryReserve(
      need, budget, [held] { return held; }, out, &held_seen, &reserved);
  EXPECT_EQ(held_seen, held);
  if (reserved_seen != nullptr) *reserved_seen = reserved;
  return ok;
}

TEST(WorkerMemoryReservationsTest, InFlightCallsAreSummed) {
  WorkerMemoryReservations r;
  Reservation first, second;
  ASSERT_TRUE(Reserve(r, 60, 100, 10, &first));
  EXPECT_EQ(first.bytes(), 60);
  EXPECT_EQ(r.reserved(), 60);
  // 10 held + 60 reserved + 60 > 100: refused, nothing reserved, the figures reported.
  int64_t reserved_seen = 0;
  EXPECT_FALSE(Reserve(r, 60, 100, 10, &second, &reserved_seen));
  EXPECT_EQ(reserved_seen, 60);
  EXPECT_EQ(second.bytes(), 0);
  EXPECT_EQ(r.reserved(), 60);
  // Exactly at the budget fits.
  ASSERT_TRUE(Reserve(r, 30, 100, 10, &second));
  EXPECT_EQ(r.reserved(), 90);
  first.Release();
  EXPECT_EQ(r.reserved(), 30);
  first.Release();  // once only
  EXPECT_EQ(r.reserved(), 30);
}

TEST(WorkerMemoryReservationsTest, SaturatedNeedIsRefused) {
  WorkerMemoryReservations r;
  Reservation a;
  EXPECT_FALSE(Reserve(r, INT64_MAX, INT64_MAX, 1, &a));
  EXPECT_EQ(r.reserved(), 0);
}

// The error paths of a call: every early return destroys its reservation.
absl::Status Step(WorkerMemoryReservations& r, int64_t need, bool fail) {
  Reservation reserved;
  if (!Reserve(r, need, 100, 0, &reserved)) return absl::ResourceExhaustedError("refused");
  if (r.reserved() < need) return absl::InternalError("not reserved while running");
  if (fail) return absl::DeadlineExceededError("the step failed");
  return absl::OkStatus();
}

TEST(WorkerMemoryReservationsTest, ReleasedOnEveryExitPath) {
  WorkerMemoryReservations r;
  EXPECT_TRUE(Step(r, 80, /*fail=*/false).ok());
  EXPECT_EQ(r.reserved(), 0);
  EXPECT_TRUE(absl::IsDeadlineExceeded(Step(r, 80, /*fail=*/true)));
  EXPECT_EQ(r.reserved(), 0);
  EXPECT_TRUE(absl::IsResourceExhausted(Step(r, 120, /*fail=*/false)));
  EXPECT_EQ(r.reserved(), 0);
  // After all of them a call of the whole budget is admitted again.
  Reservation whole;
  EXPECT_TRUE(Reserve(r, 100, 100, 0, &whole));
}

TEST(WorkerMemoryReservationsTest, MoveAddAndReuse) {
  WorkerMemoryReservations r;
  Reservation a;
  ASSERT_TRUE(Reserve(r, 40, 100, 0, &a));
  a.Add(25);  // e.g. a saved step leaving the books
  EXPECT_EQ(a.bytes(), 65);
  EXPECT_EQ(r.reserved(), 65);
  Reservation b(std::move(a));
  EXPECT_EQ(a.bytes(), 0);  // NOLINT(bugprone-use-after-move): moved-from is empty
  a.Release();              // releases nothing
  EXPECT_EQ(r.reserved(), 65);
  {
    Reservation c;
    c = std::move(b);
    EXPECT_EQ(r.reserved(), 65);
  }
  EXPECT_EQ(r.reserved(), 0);
  // An empty reservation (admission off) ignores Add.
  Reservation empty;
  empty.Add(10);
  EXPECT_EQ(empty.bytes(), 0);
  EXPECT_EQ(r.reserved(), 0);
  // Hold reserves without a check, and counts for the next TryReserve.
  Reservation held = r.Hold(50);
  EXPECT_EQ(held.bytes(), 50);
  Reservation refused;
  EXPECT_FALSE(Reserve(r, 60, 100, 0, &refused));
  held.Release();
  EXPECT_EQ(r.reserved(), 0);
  // TryReserve into a reservation that holds bytes releases them first.
  Reservation d;
  ASSERT_TRUE(Reserve(r, 70, 100, 0, &d));
  ASSERT_TRUE(Reserve(r, 90, 100, 0, &d));
  EXPECT_EQ(r.reserved(), 90);
}

// Concurrent callers never admit more than the budget together.
TEST(WorkerMemoryReservationsTest, ConcurrentCallersStayWithinTheBudget) {
  WorkerMemoryReservations r;
  constexpr int64_t kBudget = 100, kNeed = 30;
  std::atomic<int64_t> running{0};
  std::atomic<int64_t> worst{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        Reservation reserved;
        int64_t held = 0, reserved_seen = 0;
        if (!r.TryReserve(
                kNeed, kBudget, [] { return int64_t{0}; }, &reserved, &held, &reserved_seen)) {
          continue;
        }
        const int64_t now = running.fetch_add(kNeed) + kNeed;
        int64_t seen = worst.load();
        while (now > seen && !worst.compare_exchange_weak(seen, now)) {
        }
        running.fetch_sub(kNeed);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(worst.load(), kBudget - kBudget % kNeed);
  EXPECT_GT(worst.load(), 0);
  EXPECT_EQ(r.reserved(), 0);
}

}  // namespace
}  // namespace moe
