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
    // Bodies running in RunHere use the pool's books when they end.
    mu_.Await(absl::Condition(
        +[](int* here) { return *here == 0; }, &here_));
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

grpc::Status HandlerPool::RunHere(const std::string& client,
                                  absl::FunctionRef<grpc::Status()> body) {
  bool limited = false;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return refusal_;
    grpc::Status taken = TakeSlot(client, &limited);
    if (!taken.ok()) return taken;
    ++here_;
  }
  const grpc::Status status = body();
  absl::MutexLock lock(&mu_);
  --here_;
  if (limited) ReleaseClient(client);
  return status;
}

grpc::Status HandlerPool::TakeSlot(const std::string& client, bool* limited) {
  if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is stopping");
  *limited = max_per_client_ > 0 && !client.empty();
  if (*limited) {
    auto it = per_client_.find(client);
    if (it != per_client_.end() && it->second >= max_per_client_) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("this client already runs ", it->second,
                                       " calls at once (limit --handler_threads_per_client=",
                                       max_per_client_, "); retry when one of them has finished"));
    }
  }
  // Every body needs a thread of its own (they may all block): a pool thread, or its caller's.
  if (busy_ + here_ >= max_threads_) return BusyStatus();
  if (*limited) ++per_client_[client];
  return grpc::Status::OK;
}

void HandlerPool::ReleaseClient(const std::string& client) {
  auto it = per_client_.find(client);
  if (--it->second == 0) per_client_.erase(it);
}

grpc::Status HandlerPool::Queue(const std::string& client, std::function<grpc::Status()> body,
                                std::function<void(const grpc::Status&)> finish) {
  bool limited = false;
  grpc::Status taken = TakeSlot(client, &limited);
  if (!taken.ok()) return taken;
  // busy_ + here_ < max_threads_, so a thread may be started when every one is busy.
  if (busy_ >= static_cast<int>(threads_.size())) threads_.emplace_back([this] { Loop(); });
  ++busy_;
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
      if (!work.client.empty()) ReleaseClient(work.client);
    }
    work.finish(status);
  }
}

}  // namespace moe
