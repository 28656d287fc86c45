// Doorbell: a futex on a 32-bit word in shared memory, so that one process can sleep until
// another changes it (non-private futex: the word may sit at different addresses in the two
// processes' mappings of the same object). The word is a counter: Ring() increments it and
// wakes every sleeper; Wait(last_seen, deadline) returns once the word differs from
// last_seen. The protocol that makes this lossless: read Value(), THEN check the condition
// you wait for, and only if it does not hold, Wait(value): a Ring() after the read changes
// the word, so the Wait returns at once (a ring before the wait is never lost), and a word
// that did not change keeps the waiter asleep (a stale ring wakes nobody wrongly).
//
//   const uint32_t seen = bell.Value();
//   if (!ready()) RETURN_IF_ERROR(bell.Wait(seen, deadline));  // then re-check ready()
//
// Wait() may spin before it sleeps (max_spin; off by default, docs/DECISIONS.md "ring
// doorbell spin": on a loaded 2-core host it did not help). The spin adapts: it doubles (to
// max_spin) after a wait the spin satisfied and halves after one that had to sleep.
// One Doorbell object per waiting thread (the adaptive state is not shared).
#ifndef MOED_TRANSPORT_DOORBELL_H_
#define MOED_TRANSPORT_DOORBELL_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace moe {

static_assert(std::atomic<uint32_t>::is_always_lock_free, "a futex word must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "a futex word is 32 bits");

class Doorbell {
 public:
  // `word` lives in shared memory and outlives this object; 4-byte aligned.
  explicit Doorbell(std::atomic<uint32_t>* word, absl::Duration max_spin = absl::ZeroDuration())
      : word_(word), max_spin_ns_(absl::ToInt64Nanoseconds(max_spin)), spin_ns_(max_spin_ns_) {}

  uint32_t Value() const { return word_->load(std::memory_order_acquire); }

  // Increments the word and wakes every process sleeping on it.
  void Ring();

  // OK once the word != last_seen (at once if it already is); DEADLINE_EXCEEDED at `deadline`
  // (absl::InfiniteFuture() waits forever). Spurious and EINTR wake-ups are absorbed.
  absl::Status Wait(uint32_t last_seen, absl::Time deadline);

  int64_t spin_ns() const { return spin_ns_; }  // the current adaptive spin, for tests

 private:
  std::atomic<uint32_t>* word_;
  int64_t max_spin_ns_;
  int64_t spin_ns_;
};

}  // namespace moe

#endif  // MOED_TRANSPORT_DOORBELL_H_
