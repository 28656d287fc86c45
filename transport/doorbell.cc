#include "transport/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

constexpr int64_t kMinSpinNs = 500;

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Sleeps while *word == expected, at most `timeout` (null: forever). Returns errno or 0.
int FutexWait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the waker is another process.
  const long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
                          timeout, nullptr, 0);
  return rc == 0 ? 0 : errno;
}

}  // namespace

void Doorbell::Ring() {
  word_->fetch_add(1, std::memory_order_acq_rel);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word_), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

absl::Status Doorbell::Wait(uint32_t last_seen, absl::Time deadline) {
  if (Value() != last_seen) return absl::OkStatus();
  // 1. Spin: the peer is likely answering right now.
  if (spin_ns_ > 0) {
    const int64_t until = MonotonicNs() + spin_ns_;
    for (int i = 0;; ++i) {
      if (Value() != last_seen) {
        spin_ns_ = std::min(max_spin_ns_, spin_ns_ * 2);
        return absl::OkStatus();
      }
      CpuRelax();
      if ((i & 63) == 63 && MonotonicNs() >= until) break;
    }
    spin_ns_ = spin_ns_ / 2 < kMinSpinNs ? 0 : spin_ns_ / 2;
  } else if (max_spin_ns_ > 0) {
    spin_ns_ = kMinSpinNs;  // try spinning again next time
  }
  // 2. Sleep on the futex until the word changes or the deadline passes.
  const bool forever = deadline == absl::InfiniteFuture();
  while (Value() == last_seen) {
    timespec relative;
    if (!forever) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError("doorbell: no ring before the deadline");
      }
      relative = absl::ToTimespec(left);
    }
    const int error = FutexWait(word_, last_seen, forever ? nullptr : &relative);
    // 0: woken (perhaps spuriously), EAGAIN: the word had changed, EINTR: a signal,
    // ETIMEDOUT: the loop's deadline check decides. Anything else is a bug in the word.
    if (error != 0 && error != EAGAIN && error != EINTR && error != ETIMEDOUT) {
      return absl::InternalError(absl::StrCat("futex wait: errno ", error));
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
