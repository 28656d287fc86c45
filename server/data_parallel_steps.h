// The data-parallel optimizer steps of one layer (moe.v1.ApplyOptimizerRequest with
// num_ranks > 1): N ranks of one training run share the layer, their Backwards sum into its
// gradients, and each calls ApplyOptimizer for training step s. This book gathers the calls
// of step s, elects the call that completes it (the last rank to arrive) to run the optimizer
// once, makes the others wait for that call's answer, and remembers the answers of the last
// applied steps so that a repeated call is answered without stepping again.
//
//   DataParallelSteps::Arrival arrival = steps.Arrive(call, timeout, deadline, cancelled);
//   if (arrival.lead) {
//     absl::Status status = ApplyOnce(&answer);   // gradients x 1/num_ranks
//     steps.Finish(call, status, answer);          // wakes the waiting calls
//   }  // else arrival.status / arrival.answer is the step's outcome
//
// Nothing here talks to workers; waiting is bounded by the caller's deadline and by the
// step's timeout counted from its first call (then the step is dropped: ABORTED).
#ifndef MOED_SERVER_DATA_PARALLEL_STEPS_H_
#define MOED_SERVER_DATA_PARALLEL_STEPS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/moe.pb.h"

namespace moe {

inline constexpr int kMaxDataParallelRanks = 4096;
inline constexpr int kMaxRunIdBytes = 256;
// Applied steps whose answers a run keeps for repeated calls.
inline constexpr int kAppliedStepsKept = 16;

// One rank's call for a data-parallel step.
struct DataParallelCall {
  std::string run_id;
  int64_t step = 0;
  int num_ranks = 0;
  int rank = 0;
  // The optimizer, serialised: every rank of a step must ask for the same one.
  std::string optimizer;
};

// The fields of `request` as a DataParallelCall; INVALID_ARGUMENT naming a field out of range
// (num_ranks in [2, kMaxDataParallelRanks], rank in [0, num_ranks), step >= 0, run_id at
// most kMaxRunIdBytes).
absl::Status ParseDataParallelCall(const v1::ApplyOptimizerRequest& request,
                                   DataParallelCall* call);

class DataParallelSteps {
 public:
  struct Arrival {
    // This call completed its step: it must run the optimizer, then call Finish.
    bool lead = false;
    // Otherwise, the step's outcome for this call, and the answer when it is OK.
    absl::Status status;
    v1::ApplyOptimizerResponse answer;
  };

  // Counts call.rank for call.step (a rank counts once, however often it calls) and, unless
  // this call completes the step (lead), waits for the lead's answer. A step already applied
  // in this run answers at once with its recorded answer (already_applied). Waiting ends with
  // DEADLINE_EXCEEDED at `deadline`, CANCELLED when `cancelled()` says so (polled), or
  // ABORTED for every waiting call once `step_timeout` passed since the step's first call
  // without all ranks (the step is dropped; a later call for it gathers anew). A call of
  // another run while this run has a step pending is FAILED_PRECONDITION; a call whose
  // num_ranks or optimizer differs from the step's first call is INVALID_ARGUMENT.
  Arrival Arrive(const DataParallelCall& call, absl::Duration step_timeout, absl::Time deadline,
                 const std::function<bool()>& cancelled);
  // The lead's outcome of call.step: handed to every waiting call; recorded when OK (a failed
  // step is forgotten, so calling again gathers the ranks again).
  void Finish(const DataParallelCall& call, const absl::Status& status,
              const v1::ApplyOptimizerResponse& answer);
  // Ends every pending step with `why` (the layer was deleted).
  void AbortAll(const absl::Status& why);

 private:
  struct Pending {
    int num_ranks = 0;
    std::string optimizer;
    std::set<int> ranks;   // those that called
    absl::Time expires;    // first call + step_timeout
    bool leading = false;  // every rank called; the lead is applying it
    bool done = false;
    absl::Status status;
    v1::ApplyOptimizerResponse answer;
  };

  // The run, recorded answers and pending step `call` joins; a non-OK status refuses it.
  absl::Status Admit(const DataParallelCall& call, absl::Duration step_timeout,
                     std::shared_ptr<Pending>* pending, Arrival* recorded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Arrival Wait(const std::shared_ptr<Pending>& pending, const DataParallelCall& call,
               absl::Time deadline, const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the steps past their timeout that not every rank reached (ABORTED to their callers).
  void DropExpired(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void End(int64_t step, const std::shared_ptr<Pending>& pending, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Timeout(int64_t step, const Pending& pending) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::string run_id_ ABSL_GUARDED_BY(mu_);
  int64_t last_applied_ ABSL_GUARDED_BY(mu_) = -1;  // of run_id_; -1: none yet
  std::map<int64_t, v1::ApplyOptimizerResponse> applied_ ABSL_GUARDED_BY(mu_);  // the last few
  std::map<int64_t, std::shared_ptr<Pending>> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_DATA_PARALLEL_STEPS_H_
