// A mutex granted in arrival order, whose waiters may give up: how a layer's steps are
// serialised in the order the requests arrived, with client deadlines and cancellation
// honoured while waiting.
//
//   if (!layer->turn.Lock(deadline, [&] { return context->IsCancelled(); })) {
//     return absl::DeadlineExceededError("waiting for the layer");
//   }
//   ... one step ...
//   layer->turn.Unlock();
#ifndef MOED_SERVER_FIFO_MUTEX_H_
#define MOED_SERVER_FIFO_MUTEX_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moe {

class FifoMutex {
 public:
  // Waits for every earlier Lock to finish. Returns false, leaving the queue, when `deadline`
  // passes or `cancelled()` returns true first (polled every 50 ms).
  bool Lock(absl::Time deadline, const std::function<bool()>& cancelled) {
    absl::MutexLock lock(&mu_);
    const uint64_t ticket = next_ticket_++;
    queue_.push_back(ticket);
    struct Turn {
      FifoMutex* self;
      uint64_t ticket;
      bool operator()() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return !self->held_ && self->queue_.front() == ticket;
      }
    } turn{this, ticket};
    while (true) {
      if (turn()) {
        queue_.pop_front();
        held_ = true;
        return true;
      }
      if (absl::Now() >= deadline || (cancelled && cancelled())) {
        queue_.erase(std::find(queue_.begin(), queue_.end(), ticket));
        return false;
      }
      mu_.AwaitWithDeadline(absl::Condition(&turn),
                            std::min(deadline, absl::Now() + absl::Milliseconds(50)));
    }
  }

  void Unlock() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }

 private:
  absl::Mutex mu_;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);
  bool held_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace moe

#endif  // MOED_SERVER_FIFO_MUTEX_H_
