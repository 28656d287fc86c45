#include "server/callback.h"

#include "absl/strings/str_cat.h"

namespace moe {

HandlerPool::HandlerPool(int max_threads) : max_threads_(max_threads < 1 ? 1 : max_threads) {}

HandlerPool::~HandlerPool() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();  // each finishes its queue first
}

bool HandlerPool::TrySubmit(std::function<grpc::Status()> body,
                            std::function<void(const grpc::Status&)> finish) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  // Every body needs a thread of its own: they may all block.
  if (busy_ >= static_cast<int>(threads_.size())) {
    if (static_cast<int>(threads_.size()) >= max_threads_) return false;
    threads_.emplace_back([this] { Loop(); });
  }
  ++busy_;
  queue_.push_back(Work{std::move(body), std::move(finish)});
  return true;
}

grpc::Status HandlerPool::BusyStatus() const {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat("all ", max_threads_,
                                   " handler threads are busy with other calls; retry later"));
}

void HandlerPool::Loop() {
  while (true) {
    Work work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](HandlerPool* p)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return p->stopping_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping, nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    const grpc::Status status = work.body();
    work.body = nullptr;  // its captures go before the thread counts as free
    {
      absl::MutexLock lock(&mu_);
      --busy_;
    }
    work.finish(status);
  }
}

}  // namespace moe
