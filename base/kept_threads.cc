#include "base/kept_threads.h"

#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/blocking_counter.h"

namespace moe {

KeptThreads::~KeptThreads() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

size_t KeptThreads::ThreadCount() const {
  absl::MutexLock lock(&mu_);
  return threads_.size();
}

void KeptThreads::Run(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  absl::BlockingCounter done(static_cast<int>(n - 1));
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 1; i < n; ++i) queue_.push_back(Task{&fn, i, &done});
    // Every queued task has a free thread: one that waits, else a new one.
    while (free_ < queue_.size()) {
      threads_.emplace_back(&KeptThreads::Loop, this);
      ++free_;
    }
  }
  fn(0);
  done.Wait();
}

void KeptThreads::Loop() {
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty()) return;  // stopping, nothing left
    const Task task = queue_.front();
    queue_.pop_front();
    --free_;
    mu_.Unlock();
    (*task.fn)(task.index);
    mu_.Lock();
    // Free again before the caller learns the task is done, so that its next Run finds this
    // thread instead of starting another.
    ++free_;
    task.done->DecrementCount();
  }
}

}  // namespace moe
