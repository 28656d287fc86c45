#include "engine/comm/memory_kv_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace moe {

absl::Status MemoryKeyValueStore::Set(const std::string& key, const std::string& value) {
  if (key.empty()) return absl::InvalidArgumentError("key-value store: empty key");
  absl::MutexLock lock(&mu_);
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryKeyValueStore::Get(const std::string& key,
                                                     absl::Duration timeout) {
  if (key.empty()) return absl::InvalidArgumentError("key-value store: empty key");
  absl::MutexLock lock(&mu_);
  auto present = [this, &key]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.count(key) > 0; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), std::max(timeout, absl::ZeroDuration()))) {
    return absl::DeadlineExceededError(absl::StrCat(
        "key-value store: key '", key, "' not set within ", absl::FormatDuration(timeout)));
  }
  return values_[key];
}

}  // namespace moe
