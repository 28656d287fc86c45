#include "server/forward_batcher.h"

#include <algorithm>
#include <utility>

namespace moe {
namespace {

// How often a waiting member looks at its caller's cancelled().
constexpr absl::Duration kCancelPoll = absl::Milliseconds(5);

}  // namespace

absl::Status ForwardBatcher::Submit(const std::string& name, std::shared_ptr<BatchMember> member,
                                    const std::function<void(const BatchMembers&)>& run) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  member->submitted = now;
  Key& key = keys_[name];
  if (key.open != nullptr && key.open->tokens + member->tokens > options_.max_tokens) {
    key.open->go_now = true;  // full: it runs as soon as its turn comes, without new members
    key.open = nullptr;
  }
  const bool leader = key.open == nullptr;
  if (leader) {
    key.open = std::make_shared<Batch>();
    key.open->seq = key.next_seq++;
    key.open->opened = now;
  }
  std::shared_ptr<Batch> batch = key.open;
  batch->members.push_back(member);
  batch->tokens += member->tokens;
  ++key.waiting;
  if (member->deadline - now <= options_.max_delay) batch->go_now = true;
  if (batch->tokens >= options_.max_tokens) {
    batch->go_now = true;
    key.open = nullptr;
  }
  absl::Status status = leader ? Lead(key, batch, *member, run) : Follow(key, batch, *member);
  ForgetIfIdle(name);
  return status;
}

absl::Status ForwardBatcher::Lead(Key& key, const std::shared_ptr<Batch>& batch,
                                  BatchMember& self,
                                  const std::function<void(const BatchMembers&)>& run) {
  // The window: only where others are likely to come (the key's last step was merged).
  if (key.busy && !key.running) {
    mu_.AwaitWithDeadline(absl::Condition(&batch->go_now), batch->opened + options_.max_delay);
  }
  // Then the key's previous batches, in opening order.
  const uint64_t seq = batch->seq;
  auto my_turn = [&key, seq]() { return key.run_seq == seq && !key.running; };
  mu_.Await(absl::Condition(&my_turn));
  if (key.open == batch) key.open = nullptr;
  batch->started = true;
  key.running = true;
  key.waiting -= static_cast<int>(batch->members.size());
  const absl::Time start = absl::Now();
  for (const std::shared_ptr<BatchMember>& m : batch->members) m->queue_wait = start - m->submitted;
  const BatchMembers members = batch->members;
  mu_.Unlock();
  run(members);
  mu_.Lock();
  for (const std::shared_ptr<BatchMember>& m : members) m->done = true;
  key.running = false;
  key.busy = members.size() > 1;
  ++key.run_seq;
  return self.status;
}

absl::Status ForwardBatcher::Follow(Key& key, const std::shared_ptr<Batch>& batch,
                                    BatchMember& self) {
  while (!self.done) {
    const absl::Time wake = std::min(self.deadline, absl::Now() + kCancelPoll);
    if (mu_.AwaitWithDeadline(absl::Condition(&self.done), wake)) break;
    const bool cancelled = self.cancelled && self.cancelled();
    if (!cancelled && absl::Now() < self.deadline) continue;
    if (!batch->started) {
      auto it = std::find_if(batch->members.begin(), batch->members.end(),
                             [&self](const std::shared_ptr<BatchMember>& m) {
                               return m.get() == &self;
                             });
      if (it != batch->members.end()) {
        batch->tokens -= self.tokens;
        --key.waiting;
        batch->members.erase(it);
      }
    }
    return cancelled ? absl::CancelledError("client cancelled")
                     : absl::DeadlineExceededError(
                           "deadline passed while waiting for a merged forward step");
  }
  return self.status;
}

int ForwardBatcher::WaitingMembers(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(name);
  return it == keys_.end() ? 0 : it->second.waiting;
}

void ForwardBatcher::ForgetIfIdle(const std::string& name) {
  auto it = keys_.find(name);
  if (it != keys_.end() && it->second.open == nullptr && !it->second.running &&
      it->second.run_seq == it->second.next_seq && !it->second.busy) {
    keys_.erase(it);
  }
}

}  // namespace moe
