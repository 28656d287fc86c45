// HandlerPool: bodies run on their own threads, at most max_threads at once; a call beyond
// that is refused at once (never queued behind bodies that may block for minutes).
#include "server/callback.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(HandlerPoolTest, RunsBodiesConcurrentlyUpToItsLimit) {
  HandlerPool pool(2);
  absl::Notification release;
  std::atomic<int> started{0}, finished{0};
  std::atomic<int> finished_calls{0};
  auto blocking = [&] {
    ++started;
    release.WaitForNotification();
    ++finished;
    return grpc::Status::OK;
  };
  auto finish = [&](const grpc::Status& s) {
    EXPECT_TRUE(s.ok());
    ++finished_calls;
  };
  ASSERT_TRUE(pool.TrySubmit(blocking, finish));
  ASSERT_TRUE(pool.TrySubmit(blocking, finish));
  // Both run at once (neither waits for the other), and a third is refused.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (started.load() < 2 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(started.load(), 2);
  EXPECT_FALSE(pool.TrySubmit([] { return grpc::Status::OK; }, finish));
  EXPECT_EQ(pool.BusyStatus().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(pool.BusyStatus().error_message().find("2 handler threads"), std::string::npos);
  release.Notify();
  while (finished_calls.load() < 2 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(finished.load(), 2);
  EXPECT_EQ(finished_calls.load(), 2);  // the refused one was never run nor finished
  // A thread is free by the time its call is finished: one call after another, each submitted
  // once the previous one finished, never finds the pool busy (more calls than threads).
  std::atomic<int> done{0};
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(
        pool.TrySubmit([] { return grpc::Status::OK; }, [&](const grpc::Status&) { ++done; }))
        << "call " << i;
    while (done.load() <= i && absl::Now() < give_up) absl::SleepFor(absl::Microseconds(100));
  }
  EXPECT_EQ(done.load(), 20);
}

TEST(HandlerPoolTest, DestructionWaitsForQueuedAndRunningBodies) {
  std::atomic<int> ran{0};
  {
    HandlerPool pool(4);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(pool.TrySubmit(
          [] {
            absl::SleepFor(absl::Milliseconds(50));
            return grpc::Status::OK;
          },
          [&](const grpc::Status&) { ++ran; }));
    }
  }
  EXPECT_EQ(ran.load(), 4);
}

TEST(HandlerPoolTest, OneClientIsLimitedWhileOthersStillGetThreads) {
  HandlerPool pool(/*max_threads=*/8, /*max_per_client=*/2);
  absl::Notification release;
  std::atomic<int> finished{0};
  auto blocking = [&] {
    release.WaitForNotification();
    return grpc::Status::OK;
  };
  auto finish = [&](const grpc::Status&) { ++finished; };
  ASSERT_TRUE(pool.Submit("token a", blocking, finish).ok());
  ASSERT_TRUE(pool.Submit("token a", blocking, finish).ok());
  grpc::Status refused = pool.Submit("token a", blocking, finish);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("--handler_threads_per_client=2"), std::string::npos)
      << refused.error_message();
  EXPECT_TRUE(pool.Submit("token b", blocking, finish).ok());  // another client
  EXPECT_TRUE(pool.Submit("", blocking, finish).ok());         // no key: no per-client limit
  EXPECT_TRUE(pool.Submit("", blocking, finish).ok());
  EXPECT_TRUE(pool.Submit("", blocking, finish).ok());
  release.Notify();
  while (finished.load() < 6) absl::SleepFor(absl::Milliseconds(5));
  // Its calls ended: the client has its threads back.
  absl::Notification again;
  EXPECT_TRUE(pool.Submit(
                      "token a", [] { return grpc::Status::OK; },
                      [&](const grpc::Status&) { again.Notify(); })
                  .ok());
  again.WaitForNotification();
}

// moed's graceful stop: a closed pool refuses calls with the given status; the bodies already
// queued run to their end, and the service's own work (TrySubmit) still runs.
TEST(HandlerPoolTest, ClosedPoolRefusesCallsButFinishesTheAcceptedOnes) {
  HandlerPool pool(8);
  absl::Notification release, finished;
  ASSERT_TRUE(pool.Submit(
                      "client",
                      [&] {
                        release.WaitForNotification();
                        return grpc::Status::OK;
                      },
                      [&](const grpc::Status&) { finished.Notify(); })
                  .ok());
  pool.Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "stopping"));
  grpc::Status refused = pool.Submit(
      "client", [] { return grpc::Status::OK; }, [](const grpc::Status&) {});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(refused.error_message(), "stopping");
  absl::Notification internal;
  EXPECT_TRUE(pool.TrySubmit([] { return grpc::Status::OK; },
                             [&](const grpc::Status&) { internal.Notify(); }));
  internal.WaitForNotification();
  release.Notify();
  finished.WaitForNotification();
}

// RunHere: the body runs on the caller's own thread, in a slot that counts toward max_threads
// and max_per_client while it runs, and is refused as Submit is (busy, per client, closed).
TEST(HandlerPoolTest, RunHereRunsOnTheCallersThreadInASlotOfThePool) {
  HandlerPool pool(/*max_threads=*/2, /*max_per_client=*/1);
  const std::thread::id me = std::this_thread::get_id();
  std::thread::id ran_on;
  EXPECT_TRUE(pool.RunHere("a", [&] {
                    ran_on = std::this_thread::get_id();
                    return grpc::Status::OK;
                  })
                  .ok());
  EXPECT_EQ(ran_on, me);
  // The body's status is what RunHere returns.
  EXPECT_EQ(pool.RunHere("a", [] { return grpc::Status(grpc::StatusCode::NOT_FOUND, "x"); })
                .error_code(),
            grpc::StatusCode::NOT_FOUND);

  // While a body of "a" runs here: "a" has no second slot (per client), "b" takes the second
  // thread's slot, and then the pool is full for everyone (Submit, TrySubmit, RunHere).
  absl::Notification inside, release, b_started, b_release;
  std::thread holder([&] {
    EXPECT_TRUE(pool.RunHere("a", [&] {
                      inside.Notify();
                      release.WaitForNotification();
                      return grpc::Status::OK;
                    })
                    .ok());
  });
  inside.WaitForNotification();
  bool ran = false;
  grpc::Status refused = pool.RunHere("a", [&] {
    ran = true;
    return grpc::Status::OK;
  });
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("--handler_threads_per_client=1"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(pool.Submit("a", [] { return grpc::Status::OK; }, [](const grpc::Status&) {})
                .error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  std::atomic<int> finished{0};
  ASSERT_TRUE(pool.Submit(
                      "b",
                      [&] {
                        b_started.Notify();
                        b_release.WaitForNotification();
                        return grpc::Status::OK;
                      },
                      [&](const grpc::Status&) { ++finished; })
                  .ok());
  b_started.WaitForNotification();
  refused = pool.RunHere("c", [&] {
    ran = true;
    return grpc::Status::OK;
  });
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(refused.error_message(), pool.BusyStatus().error_message());
  EXPECT_FALSE(pool.TrySubmit([] { return grpc::Status::OK; }, [](const grpc::Status&) {}));
  EXPECT_EQ(pool.Submit("", [] { return grpc::Status::OK; }, [](const grpc::Status&) {})
                .error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_FALSE(ran);  // a refused body never runs
  release.Notify();
  holder.join();
  // Its slot is back: "a" runs here again, and a pool thread can be had beside "b"'s.
  EXPECT_TRUE(pool.RunHere("a", [] { return grpc::Status::OK; }).ok());
  absl::Notification queued_ran;
  EXPECT_TRUE(pool.Submit("d", [] { return grpc::Status::OK; },
                          [&](const grpc::Status&) { queued_ran.Notify(); })
                  .ok());
  queued_ran.WaitForNotification();
  b_release.Notify();
  while (finished.load() < 1) absl::SleepFor(absl::Milliseconds(1));
}

// The graceful stop's Close() refuses RunHere with its status; a body running here finishes.
TEST(HandlerPoolTest, ClosedPoolRefusesRunHere) {
  HandlerPool pool(4);
  absl::Notification inside, release;
  std::thread holder([&] {
    EXPECT_TRUE(pool.RunHere("client", [&] {
                      inside.Notify();
                      release.WaitForNotification();
                      return grpc::Status::OK;
                    })
                    .ok());
  });
  inside.WaitForNotification();
  pool.Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "stopping"));
  bool ran = false;
  grpc::Status refused = pool.RunHere("client", [&] {
    ran = true;
    return grpc::Status::OK;
  });
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(refused.error_message(), "stopping");
  EXPECT_FALSE(ran);
  release.Notify();
  holder.join();
}

}  // namespace
}  // namespace moe
