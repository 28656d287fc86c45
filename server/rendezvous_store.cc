#include "server/rendezvous_store.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace moe {
namespace {

// The generation of "g<generation>/...", or -1.
int64_t GenerationOf(const std::string& key) {
  const size_t slash = key.find('/');
  if (key.size() < 3 || key[0] != 'g' || slash == std::string::npos || slash < 2) return -1;
  int64_t generation = -1;
  if (!absl::SimpleAtoi(absl::string_view(key).substr(1, slash - 1), &generation)) return -1;
  return generation >= 0 ? generation : -1;
}

int64_t EntryBytes(const std::string& key, const std::string& value) {
  return static_cast<int64_t>(key.size() + value.size());
}

}  // namespace

absl::Status RendezvousStore::Set(const std::string& key, const std::string& value) {
  const int64_t generation = GenerationOf(key);
  if (generation < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("key '", key.substr(0, 64), "': must start with g<generation>/"));
  }
  absl::MutexLock lock(&mu_);
  if (generation < first_generation_) {
    return absl::FailedPreconditionError(absl::StrCat("key '", key.substr(0, 64), "': generation ",
                                                      generation, " is over (now ",
                                                      first_generation_, " or later)"));
  }
  auto it = values_.find(key);
  const int64_t replaced = it == values_.end() ? 0 : EntryBytes(key, it->second);
  const int64_t bytes = bytes_ - replaced + EntryBytes(key, value);
  if (bytes > limits_.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rendezvous store: ", bytes,
                     " bytes with this value, past --rendezvous_max_bytes=", limits_.max_bytes));
  }
  if (it == values_.end() && static_cast<int64_t>(values_.size()) >= limits_.max_keys) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rendezvous store: ", values_.size(),
                     " keys, at --rendezvous_max_keys=", limits_.max_keys));
  }
  bytes_ = bytes;
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousStore::Get(const std::string& key, absl::Duration timeout,
                                                 const std::string& caller,
                                                 const std::function<bool()>& cancelled) {
  if (GenerationOf(key) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("key '", key.substr(0, 64), "': must start with g<generation>/"));
  }
  const absl::Time give_up = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  if (it != values_.end()) return it->second;
  if (waiting_ >= limits_.max_waiting) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rendezvous store: ", waiting_,
                     " reads wait for keys, at --rendezvous_max_waiting=", limits_.max_waiting));
  }
  int& mine = waiting_by_caller_[caller];
  if (mine >= limits_.max_waiting_per_caller) {
    return absl::ResourceExhaustedError(absl::StrCat("rendezvous store: ", mine,
                                                     " reads of this caller wait for keys, at "
                                                     "--rendezvous_max_waiting_per_caller=",
                                                     limits_.max_waiting_per_caller));
  }
  ++waiting_;
  ++mine;
  // Waits in slices so that a cancelled call (the worker gave up, or Server::Shutdown
  // cancelled it) frees its handler thread within one slice instead of at its timeout.
  constexpr absl::Duration kSlice = absl::Milliseconds(200);
  absl::StatusOr<std::string> result;
  while (true) {
    auto has_key = [this, &key]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.count(key) > 0; };
    const absl::Duration left = give_up - absl::Now();
    if (mu_.AwaitWithTimeout(absl::Condition(&has_key), std::min(left, kSlice))) {
      result = values_.at(key);
      break;
    }
    if (left <= kSlice) {
      result = absl::DeadlineExceededError(absl::StrCat("key-value store: key '", key.substr(0, 64),
                                                        "' not set within ",
                                                        absl::FormatDuration(timeout)));
      break;
    }
    mu_.Unlock();
    const bool stop = cancelled();
    mu_.Lock();
    if (stop) {
      result = absl::CancelledError("StoreGet cancelled");
      break;
    }
  }
  --waiting_;
  if (--waiting_by_caller_[caller] == 0) waiting_by_caller_.erase(caller);
  return result;
}

void RendezvousStore::DropGenerationsBefore(int64_t generation) {
  absl::MutexLock lock(&mu_);
  first_generation_ = std::max(first_generation_, generation);
  for (auto it = values_.begin(); it != values_.end();) {
    if (GenerationOf(it->first) < first_generation_) {
      bytes_ -= EntryBytes(it->first, it->second);
      it = values_.erase(it);
    } else {
      ++it;
    }
  }
}

int64_t RendezvousStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

int64_t RendezvousStore::keys() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(values_.size());
}

}  // namespace moe
