#include "server/saved_steps.h"

#include "absl/strings/str_cat.h"

namespace moe {

absl::Status SavedSteps::CheckRoom() const {
  if (count() >= limits_.max_steps) {
    return absl::ResourceExhaustedError(
        absl::StrCat("keep_for_backward: layer \"", layer_name_, "\" already holds ", steps_.size(),
                     " saved steps (limit --max_saved_steps=", limits_.max_steps,
                     "); call Backward or ReleaseStep first"));
  }
  if (bytes_ >= limits_.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("keep_for_backward: layer \"", layer_name_, "\" saved steps hold ", bytes_,
                     " bytes (limit --max_saved_bytes=", limits_.max_bytes, ")"));
  }
  return absl::OkStatus();
}

void SavedSteps::Add(uint64_t step_id, const SavedStep& step) {
  auto [it, added] = steps_.emplace(step_id, step);
  if (!added) {
    bytes_ -= it->second.bytes;
    it->second = step;
  }
  bytes_ += step.bytes;
}

absl::Status SavedSteps::CheckBytes(int64_t step_bytes) const {
  if (bytes_ <= limits_.max_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("keep_for_backward: this step needs ", step_bytes,
                   " bytes; the layer's saved steps would hold ", bytes_,
                   " bytes (limit --max_saved_bytes=", limits_.max_bytes, ")"));
}

absl::StatusOr<SavedStep> SavedSteps::Find(uint64_t step_id, bool issued) const {
  auto it = steps_.find(step_id);
  if (it != steps_.end()) return it->second;
  if (expired_.count(step_id) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("step_id: ", step_id, " expired: not used by a Backward within ",
                     absl::FormatDuration(limits_.ttl),
                     " of its Forward (server flag --saved_step_ttl_s); its saved activations were "
                     "released"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "step_id: ", step_id,
      issued ? " is not held by layer \"" + layer_name_ +
                   "\" (released, already used by a Backward, dropped when the workers "
                   "re-formed, or a step of another layer)"
             : std::string(" was never issued")));
}

bool SavedSteps::Remove(uint64_t step_id) {
  auto it = steps_.find(step_id);
  if (it == steps_.end()) return false;
  bytes_ -= it->second.bytes;
  steps_.erase(it);
  return true;
}

bool SavedSteps::AnyDue(absl::Time now) const {
  if (limits_.ttl <= absl::ZeroDuration()) return false;
  const absl::Time cutoff = now - limits_.ttl;
  for (const auto& kv : steps_) {
    if (kv.second.saved_at <= cutoff) return true;
  }
  return false;
}

std::vector<uint64_t> SavedSteps::Expire(absl::Time now) {
  std::vector<uint64_t> ids;
  if (limits_.ttl <= absl::ZeroDuration()) return ids;
  const absl::Time cutoff = now - limits_.ttl;
  for (auto it = steps_.begin(); it != steps_.end();) {
    if (it->second.saved_at > cutoff) {
      ++it;
      continue;
    }
    ids.push_back(it->first);
    expired_.insert(it->first);
    bytes_ -= it->second.bytes;
    it = steps_.erase(it);
  }
  while (expired_.size() > kExpiredKept) expired_.erase(expired_.begin());
  return ids;
}

void SavedSteps::Clear() {
  steps_.clear();
  bytes_ = 0;
}

}  // namespace moe
