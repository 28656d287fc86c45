// The front end's books of one layer's saved steps (Forward with keep_for_backward): which steps
// the workers hold for a Backward, their tokens, datatype and bytes, the per-layer budget
// (--max_saved_steps, --max_saved_bytes), and the ids released by --saved_step_ttl_s, so that a
// late Backward hears why its step is gone. The books only: releasing a step's memory on the
// workers is the caller's (MoeServiceImpl::ReleaseOnWorkers).
//
// Not thread-safe: MoeServiceImpl keeps one per layer, guarded by the layer's mu.
//
//   SavedSteps saved("ffn0", {.max_steps = 64, .max_bytes = 8 << 30, .ttl = absl::Minutes(10)});
//   RETURN_IF_ERROR(saved.CheckRoom());              // before a keep_for_backward Forward
//   saved.Add(step_id, {tokens, dtype, bytes, absl::Now()});
//   ASSIGN_OR_RETURN(SavedStep step, saved.Find(step_id, /*issued=*/true));  // Backward
//   saved.Remove(step_id);                          // consumed or released
//   std::vector<uint64_t> gone = saved.Expire(absl::Now());  // housekeeping
#ifndef MOED_SERVER_SAVED_STEPS_H_
#define MOED_SERVER_SAVED_STEPS_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/dtype.h"

namespace moe {

struct SavedStepLimits {
  int64_t max_steps = 64;                // --max_saved_steps
  int64_t max_bytes = int64_t{8} << 30;  // --max_saved_bytes, summed over workers
  // --saved_step_ttl_s: a step saved this long ago is due for Expire. Zero: never.
  absl::Duration ttl = absl::Seconds(600);
};

// What the workers keep of one Forward for its Backward.
struct SavedStep {
  int64_t tokens = 0;
  DType dtype = DType::kFloat32;
  int64_t bytes = 0;    // on all workers together
  absl::Time saved_at;  // for the ttl
};

class SavedSteps {
 public:
  // Ids of expired steps remembered for Find's error (the latest ones).
  static constexpr size_t kExpiredKept = 4096;

  SavedSteps(std::string layer_name, SavedStepLimits limits)
      : layer_name_(std::move(layer_name)), limits_(limits) {}

  // RESOURCE_EXHAUSTED naming the flag when the layer already holds max_steps steps or
  // max_bytes bytes: a keep_for_backward Forward is refused before it runs.
  absl::Status CheckRoom() const;
  // Books a step the workers saved; its bytes count at once (a step that takes the total past
  // max_bytes is detected by CheckBytes afterwards).
  void Add(uint64_t step_id, const SavedStep& step);
  // RESOURCE_EXHAUSTED when the books hold more than max_bytes, naming the `step_bytes` of the
  // step just added: the caller removes it and releases it on the workers.
  absl::Status CheckBytes(int64_t step_bytes) const;
  // The step for a Backward. FAILED_PRECONDITION saying why when it is not held: expired (by the
  // ttl), or released / used / dropped by a re-formation / another layer's when `issued` (the
  // id was handed out by this server), else never issued.
  absl::StatusOr<SavedStep> Find(uint64_t step_id, bool issued) const;
  // Drops the step from the books; false when it was not held.
  bool Remove(uint64_t step_id);
  // Whether a step is due for Expire at `now`.
  bool AnyDue(absl::Time now) const;
  // Drops the steps saved at least ttl before `now`, remembering their ids for Find's error;
  // returns their ids (for the workers' release). Nothing with a zero ttl.
  std::vector<uint64_t> Expire(absl::Time now);
  // Drops every step (the workers dropped theirs: re-formation, LoadCheckpoint).
  void Clear();

  int64_t count() const { return static_cast<int64_t>(steps_.size()); }
  int64_t bytes() const { return bytes_; }
  const SavedStepLimits& limits() const { return limits_; }

 private:
  const std::string layer_name_;
  const SavedStepLimits limits_;
  std::map<uint64_t, SavedStep> steps_;
  std::set<uint64_t> expired_;
  int64_t bytes_ = 0;  // sum of steps_' bytes
};

}  // namespace moe

#endif  // MOED_SERVER_SAVED_STEPS_H_
