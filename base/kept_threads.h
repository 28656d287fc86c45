// Threads for work that a call fans out and waits for, kept between calls instead of started
// and joined each time: the lanes of the C++ client's staged steps (client/moe_client_lanes.cc:
// 7 threads for the staging and 7 for the fetching of each step over 8 lanes before) and moed's
// calls to every worker of a step (server/worker_pool_fanout.cc). A thread is started only when
// no kept one is free (several callers at once each get their own), and every thread started
// is kept until the object is destroyed, so it holds as many threads as were ever busy at
// once, not counting the callers'.
//
//   KeptThreads threads;
//   threads.Run(lanes, [&](size_t lane) { SendPart(lane); });  // lane 0 on this thread
#ifndef MOED_BASE_KEPT_THREADS_H_
#define MOED_BASE_KEPT_THREADS_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"

namespace moe {

class KeptThreads {
 public:
  KeptThreads() = default;
  ~KeptThreads();  // joins every thread; no Run may be in progress
  KeptThreads(const KeptThreads&) = delete;
  KeptThreads& operator=(const KeptThreads&) = delete;

  // Runs fn(0) on the calling thread and fn(1) .. fn(n - 1) on pool threads, concurrently;
  // returns when every one has returned. Safe to call from several threads at once.
  void Run(size_t n, const std::function<void(size_t)>& fn);

  // Threads started so far (for tests).
  size_t ThreadCount() const;

 private:
  void Loop();

  mutable absl::Mutex mu_;
  struct Task {
    const std::function<void(size_t)>* fn;
    size_t index;
    absl::BlockingCounter* done;
  };
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  // Threads not running a task (waiting for one, or not started yet); Run keeps it at least
  // queue_.size().
  size_t free_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_BASE_KEPT_THREADS_H_
