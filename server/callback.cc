#include "server/callback.h"

#include "absl/strings/str_cat.h"

namespace moe {

HandlerPool::HandlerPool(int max_threads, int max_per_client)
    : max_threads_(max_threads < 1 ? 1 : max_threads),
      max_per_client_(max_per_client < 0 ? 0 : max_per_client) {}

std::string PeerHost(const grpc::ServerContextBase& context) {
  // "ipv4:10.0.0.7:41234", "ipv6:[::1]:41234", "unix:/path": drop the port.
  std::string peer = context.peer();
  if (peer.rfind("ipv4:", 0) == 0 || peer.rfind("ipv6:", 0) == 0) {
    const size_t colon = peer.rfind(':');
    if (colon > 5) peer.resize(colon);
  }
  return peer;
}

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
  return Queue("", std::move(body), std::move(finish)).ok();
}

grpc::Status HandlerPool::Submit(const std::string& client, std::function<grpc::Status()> body,
                                 std::function<void(const grpc::Status&)> finish) {
  absl::MutexLock lock(&mu_);
  if (closed_) return refusal_;
  return Queue(client, std::move(body), std::move(finish));
}

void HandlerPool::Close(grpc::Status refusal) {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  refusal_ = std::move(refusal);
}

grpc::Status HandlerPool::Queue(const std::string& client, std::function<grpc::Status()> body,
                                std::function<void(const grpc::Status&)> finish) {
  if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is stopping");
  const bool limited = max_per_client_ > 0 && !client.empty();
  if (limited) {
    auto it = per_client_.find(client);
    if (it != per_client_.end() && it->second >= max_per_client_) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("this client already runs ", it->second,
                                       " calls at once (limit --handler_threads_per_client=",
                                       max_per_client_, "); retry when one of them has finished"));
    }
  }
  // Every body needs a thread of its own: they may all block.
  if (busy_ >= static_cast<int>(threads_.size())) {
    if (static_cast<int>(threads_.size()) >= max_threads_) return BusyStatus();
    threads_.emplace_back([this] { Loop(); });
  }
  ++busy_;
  if (limited) ++per_client_[client];
  queue_.push_back(Work{limited ? client : std::string(), std::move(body), std::move(finish)});
  return grpc::Status::OK;
}

grpc::Status HandlerPool::BusyStatus() const {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat("all ", max_threads_,
                                   " handler threads are busy with other calls (limit "
                                   "--handler_threads); retry later"));
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
      if (!work.client.empty()) {
        auto it = per_client_.find(work.client);
        if (--it->second == 0) per_client_.erase(it);
      }
    }
    work.finish(status);
  }
}

}  // namespace moe
