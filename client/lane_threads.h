// Threads for the lanes of a staged step (client/moe_client_lanes.cc), kept between steps:
// a step over 8 lanes used to start and join 7 threads for its staging and 7 more for its
// fetching. A thread is started only when no kept one is idle (several callers sharing one
// client each get their own), and every thread started is kept until the pool is destroyed,
// so the pool holds as many threads as lanes were ever busy at once, minus the callers'.
//
//   LaneThreads threads;
//   threads.Run(lanes, [&](size_t lane) { SendPart(lane); });  // lane 0 on this thread
#ifndef MOED_CLIENT_LANE_THREADS_H_
#define MOED_CLIENT_LANE_THREADS_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"

namespace moe {
namespace client {

class LaneThreads {
 public:
  LaneThreads() = default;
  ~LaneThreads();  // joins every thread; no Run may be in progress
  LaneThreads(const LaneThreads&) = delete;
  LaneThreads& operator=(const LaneThreads&) = delete;

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
    size_t lane;
    absl::BlockingCounter* done;
  };
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  // Threads not running a task (waiting for one, or not started yet); Run keeps it at least
  // queue_.size().
  size_t free_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_LANE_THREADS_H_
