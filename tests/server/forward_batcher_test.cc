// server/forward_batcher.h without a server: batches form while a key's step runs, respect
// max_tokens, run in order; a member that cancels leaves without failing the others; a close
// deadline skips the window; a lone caller never waits.
#include "server/forward_batcher.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

struct TestMember : BatchMember {
  int id = 0;
  int batch_size = 0;  // written by run: members in its step
};

std::shared_ptr<TestMember> Member(int id, int64_t tokens) {
  auto m = std::make_shared<TestMember>();
  m->id = id;
  m->tokens = tokens;
  return m;
}

// Records every run's members and tokens; the first run waits for `release` when given.
class Recorder {
 public:
  explicit Recorder(absl::Notification* release = nullptr) : release_(release) {}
  std::function<void(const BatchMembers&)> Run() {
    return [this](const BatchMembers& batch) {
      int64_t tokens = 0;
      for (const auto& m : batch) {
        tokens += m->tokens;
        static_cast<TestMember*>(m.get())->batch_size = static_cast<int>(batch.size());
        m->status = absl::OkStatus();
      }
      {
        absl::MutexLock lock(&mu_);
        sizes_.push_back(static_cast<int>(batch.size()));
        tokens_.push_back(tokens);
        if (release_ != nullptr && sizes_.size() == 1) {
          mu_.Unlock();
          release_->WaitForNotification();
          mu_.Lock();
        }
      }
    };
  }
  std::vector<int> sizes() {
    absl::MutexLock lock(&mu_);
    return sizes_;
  }
  std::vector<int64_t> tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }

 private:
  absl::Notification* release_;
  absl::Mutex mu_;
  std::vector<int> sizes_;
  std::vector<int64_t> tokens_;
};

void WaitForMembers(const ForwardBatcher& batcher, const std::string& key, int n) {
  while (batcher.WaitingMembers(key) < n) absl::SleepFor(absl::Milliseconds(1));
}

TEST(ForwardBatcherTest, CallersArrivingDuringAStepShareTheNext) {
  ForwardBatcher batcher(ForwardBatchingOptions{});
  absl::Notification release;
  Recorder recorder(&release);
  std::vector<std::shared_ptr<TestMember>> members;
  for (int i = 0; i < 9; ++i) members.push_back(Member(i, 4));
  std::vector<std::thread> threads;
  std::vector<absl::Status> got(9);
  // The first runs alone (a lone caller does not wait) and holds its step...
  threads.emplace_back([&] { got[0] = batcher.Submit("k", members[0], recorder.Run()); });
  while (recorder.sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
  // ...while eight others arrive: one batch.
  for (int i = 1; i < 9; ++i) {
    threads.emplace_back([&, i] { got[i] = batcher.Submit("k", members[i], recorder.Run()); });
  }
  WaitForMembers(batcher, "k", 8);
  release.Notify();
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : got) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(recorder.sizes(), (std::vector<int>{1, 8}));
  EXPECT_EQ(members[0]->batch_size, 1);
  for (int i = 1; i < 9; ++i) EXPECT_EQ(members[i]->batch_size, 8);
  EXPECT_EQ(batcher.WaitingMembers("k"), 0);
}

TEST(ForwardBatcherTest, MergedStepsHoldAtMostMaxTokens) {
  ForwardBatchingOptions options;
  options.max_tokens = 10;
  ForwardBatcher batcher(options);
  absl::Notification release;
  Recorder recorder(&release);
  std::vector<std::thread> threads;
  threads.emplace_back([&] { batcher.Submit("k", Member(0, 3), recorder.Run()).IgnoreError(); });
  while (recorder.sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
  for (int i = 1; i <= 7; ++i) {
    threads.emplace_back([&, i] { batcher.Submit("k", Member(i, 3), recorder.Run()).IgnoreError(); });
  }
  WaitForMembers(batcher, "k", 7);
  release.Notify();
  for (std::thread& t : threads) t.join();
  int64_t total = 0;
  for (int64_t t : recorder.tokens()) {
    EXPECT_LE(t, 10);
    total += t;
  }
  EXPECT_EQ(total, 8 * 3);
  // 7 members of 3 tokens after the first: three per step at most, so three steps.
  EXPECT_EQ(recorder.sizes().size(), 4u);
}

TEST(ForwardBatcherTest, AMemberThatCancelsLeavesAndTheOthersComplete) {
  ForwardBatcher batcher(ForwardBatchingOptions{});
  absl::Notification release;
  Recorder recorder(&release);
  std::atomic<bool> cancel{false};
  auto leaving = Member(2, 5);
  leaving->cancelled = [&cancel] { return cancel.load(); };
  auto staying = Member(1, 7);
  absl::Status leaving_status, staying_status;
  std::thread first([&] { batcher.Submit("k", Member(0, 1), recorder.Run()).IgnoreError(); });
  while (recorder.sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
  std::thread a([&] { staying_status = batcher.Submit("k", staying, recorder.Run()); });
  WaitForMembers(batcher, "k", 1);
  std::thread b([&] { leaving_status = batcher.Submit("k", leaving, recorder.Run()); });
  WaitForMembers(batcher, "k", 2);
  cancel = true;
  b.join();  // returns before the batch runs
  EXPECT_EQ(leaving_status.code(), absl::StatusCode::kCancelled);
  release.Notify();
  first.join();
  a.join();
  EXPECT_TRUE(staying_status.ok()) << staying_status;
  EXPECT_EQ(recorder.sizes(), (std::vector<int>{1, 1}));  // it was dropped from the batch
  EXPECT_EQ(recorder.tokens()[1], 7);
}

TEST(ForwardBatcherTest, ALeaderWhoseCallerCancelledStillRunsItsBatch) {
  ForwardBatcher batcher(ForwardBatchingOptions{});
  absl::Notification release;
  Recorder recorder(&release);
  std::thread first([&] { batcher.Submit("k", Member(0, 1), recorder.Run()).IgnoreError(); });
  while (recorder.sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
  auto leader = Member(1, 2);
  leader->cancelled = [] { return true; };
  auto follower = Member(2, 2);
  absl::Status follower_status;
  std::thread a([&] { batcher.Submit("k", leader, recorder.Run()).IgnoreError(); });
  WaitForMembers(batcher, "k", 1);
  std::thread b([&] { follower_status = batcher.Submit("k", follower, recorder.Run()); });
  WaitForMembers(batcher, "k", 2);
  release.Notify();
  for (std::thread* t : {&first, &a, &b}) t->join();
  EXPECT_TRUE(follower_status.ok()) << follower_status;
  EXPECT_EQ(follower->batch_size, 2);
}

// A busy key (its last step merged two) waits up to max_delay for more; a member whose
// deadline is closer than that goes at once. With an hour's window this test only ends
// because of that rule.
TEST(ForwardBatcherTest, ACloseDeadlineSkipsTheWindow) {
  ForwardBatchingOptions options;
  options.max_delay = absl::Hours(1);
  ForwardBatcher batcher(options);
  absl::Notification release;
  Recorder recorder(&release);
  std::thread first([&] { batcher.Submit("k", Member(0, 1), recorder.Run()).IgnoreError(); });
  while (recorder.sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
  std::vector<std::thread> pair;
  for (int i = 1; i <= 2; ++i) {
    auto m = Member(i, 1);
    m->deadline = absl::Now() + absl::Minutes(10);
    pair.emplace_back([&, m] { batcher.Submit("k", m, recorder.Run()).IgnoreError(); });
  }
  WaitForMembers(batcher, "k", 2);
  release.Notify();
  first.join();
  for (std::thread& t : pair) t.join();
  ASSERT_EQ(recorder.sizes(), (std::vector<int>{1, 2}));  // the key is now busy
  auto urgent = Member(3, 1);
  urgent->deadline = absl::Now() + absl::Minutes(10);
  EXPECT_TRUE(batcher.Submit("k", urgent, recorder.Run()).ok());
  EXPECT_EQ(recorder.sizes().back(), 1);
  EXPECT_GE(urgent->queue_wait, absl::ZeroDuration());
}

TEST(ForwardBatcherTest, KeysDoNotMerge) {
  ForwardBatcher batcher(ForwardBatchingOptions{});
  absl::Notification release;
  Recorder recorder(&release);
  std::thread first([&] { batcher.Submit("a", Member(0, 1), recorder.Run()).IgnoreError(); });
  while (recorder.sizes().empty()) absl::SleepFor(absl::Milliseconds(1));
  // Key b is idle: its caller runs at once although a's step holds the recorder's first run.
  Recorder other;
  EXPECT_TRUE(batcher.Submit("b", Member(1, 1), other.Run()).ok());
  EXPECT_EQ(other.sizes(), (std::vector<int>{1}));
  release.Notify();
  first.join();
}

}  // namespace
}  // namespace moe
