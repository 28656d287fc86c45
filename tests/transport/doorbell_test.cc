// Doorbell (transport/doorbell.h) between two processes: a ring wakes the waiter, a ring
// before the wait is not lost, no ring (or a FUTEX_WAKE without a ring) wakes nobody, the
// deadline holds.
#include "transport/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <new>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/shm_object.h"

namespace moe {
namespace {

struct SharedWord {
  ShmObject object;
  ShmMapping mapping;
  std::atomic<uint32_t>* word = nullptr;
  std::atomic<uint32_t>* flag = nullptr;  // a second word: "the child is about to wait"
};

SharedWord MakeWord() {
  SharedWord shared;
  shared.object = *ShmObject::CreateAnonymous("doorbell-test", 4096);
  shared.mapping = *shared.object.Map();
  shared.word = new (shared.mapping.data()) std::atomic<uint32_t>(0);
  shared.flag = new (shared.mapping.data() + 64) std::atomic<uint32_t>(0);
  return shared;
}

// Forks a child that waits (from `seen`) with `timeout`; exit 0 when woken, 1 at the deadline.
pid_t ForkWaiter(SharedWord& shared, uint32_t seen, absl::Duration timeout,
                 absl::Duration max_spin) {
  const pid_t pid = fork();
  if (pid == 0) {
    Doorbell bell(shared.word, max_spin);
    shared.flag->store(1);
    const absl::Status s = bell.Wait(seen, absl::Now() + timeout);
    _exit(s.ok() ? 0 : absl::IsDeadlineExceeded(s) ? 1 : 2);
  }
  return pid;
}

int ExitCode(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

class DoorbellTest : public ::testing::TestWithParam<int> {  // max spin in µs
 protected:
  absl::Duration spin() const { return absl::Microseconds(GetParam()); }
};

TEST_P(DoorbellTest, RingWakesAnotherProcess) {
  SharedWord shared = MakeWord();
  const pid_t child = ForkWaiter(shared, 0, absl::Seconds(10), spin());
  while (shared.flag->load() == 0) absl::SleepFor(absl::Microseconds(100));
  absl::SleepFor(absl::Milliseconds(30));  // the child is asleep on the futex by now
  const absl::Time rung = absl::Now();
  Doorbell(shared.word).Ring();
  EXPECT_EQ(ExitCode(child), 0);
  EXPECT_LT(absl::Now() - rung, absl::Seconds(2));
  EXPECT_EQ(shared.word->load(), 1u);
}

TEST_P(DoorbellTest, RingBeforeTheWaitIsNotLost) {
  SharedWord shared = MakeWord();
  Doorbell bell(shared.word, spin());
  const uint32_t seen = bell.Value();
  Doorbell(shared.word).Ring();  // the peer rings between our read and our wait
  const absl::Time start = absl::Now();
  EXPECT_TRUE(bell.Wait(seen, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  // Also across processes: the child waits from a value already stale.
  const pid_t child = ForkWaiter(shared, seen, absl::Seconds(5), spin());
  EXPECT_EQ(ExitCode(child), 0);
}

TEST_P(DoorbellTest, NoRingWakesNobody) {
  SharedWord shared = MakeWord();
  Doorbell bell(shared.word, spin());
  const absl::Time start = absl::Now();
  EXPECT_TRUE(absl::IsDeadlineExceeded(bell.Wait(0, start + absl::Milliseconds(50))));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));

  // A FUTEX_WAKE without a new value (a stale or spurious wake-up) keeps the child waiting.
  const pid_t child = ForkWaiter(shared, 0, absl::Milliseconds(300), spin());
  while (shared.flag->load() == 0) absl::SleepFor(absl::Microseconds(100));
  for (int i = 0; i < 20; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(shared.word), FUTEX_WAKE, INT_MAX, nullptr,
            nullptr, 0);
  }
  EXPECT_EQ(ExitCode(child), 1);  // DEADLINE_EXCEEDED, not woken
}

TEST_P(DoorbellTest, DeadlineInThePastReturnsAtOnce) {
  SharedWord shared = MakeWord();
  Doorbell bell(shared.word, spin());
  EXPECT_TRUE(absl::IsDeadlineExceeded(bell.Wait(0, absl::Now() - absl::Seconds(1))));
  EXPECT_TRUE(bell.Wait(7, absl::Now() - absl::Seconds(1)).ok());  // already different
}

INSTANTIATE_TEST_SUITE_P(Spin, DoorbellTest, ::testing::Values(0, 20));

TEST(DoorbellSpinTest, SpinShrinksWhileThePeerIsSlow) {
  SharedWord shared = MakeWord();
  Doorbell bell(shared.word, absl::Microseconds(20));
  for (int i = 0; i < 8; ++i) {
    (void)bell.Wait(0, absl::Now() + absl::Milliseconds(1));
  }
  EXPECT_LT(bell.spin_ns(), 20000);
}

}  // namespace
}  // namespace moe
