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
//
// A run belongs to the caller that opened it (DataParallelCall::owner: the bearer token's
// identity, MoeServiceImpl::ClientOf): another caller naming its run_id is PERMISSION_DENIED
// and counts for nothing. Each owner has its own run on the layer (one at a time: a second
// run_id of the same owner waits until the first has nothing pending), so one caller's
// pending step never holds up another caller's run.
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
  std::string owner;  // the caller's identity; a run answers only its owner
  std::string run_id;
  int64_t step = 0;
  int num_ranks = 0;
  int rank = 0;
  // The optimizer, serialised: every rank of a step must ask for the same one.
  std::string optimizer;
};

// The fields of `request` as a DataParallelCall of `owner`; INVALID_ARGUMENT naming a field
// out of range (num_ranks in [2, max_ranks], max_ranks at most kMaxDataParallelRanks
// (moed --max_dp_ranks), rank in [0, num_ranks), step >= 0, run_id at most kMaxRunIdBytes).
absl::Status ParseDataParallelCall(const v1::ApplyOptimizerRequest& request,
                                   const std::string& owner, int max_ranks, DataParallelCall* call);

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
  // without all ranks (the step is dropped; a later call for it gathers anew). A call naming
  // the run of another owner is PERMISSION_DENIED; a call of another run of the same owner
  // while its run has a step pending is FAILED_PRECONDITION; a call whose num_ranks or
  // optimizer differs from the step's first call is INVALID_ARGUMENT.
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

  // One owner's run on the layer.
  struct Run {
    std::string run_id;
    int64_t last_applied = -1;                              // -1: none yet
    std::map<int64_t, v1::ApplyOptimizerResponse> applied;  // the last few
    std::map<int64_t, std::shared_ptr<Pending>> pending;
  };

  // The run, recorded answers and pending step `call` joins; a non-OK status refuses it.
  absl::Status Admit(const DataParallelCall& call, absl::Duration step_timeout,
                     std::shared_ptr<Pending>* pending, Arrival* recorded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Arrival Wait(Run& run, const std::shared_ptr<Pending>& pending, const DataParallelCall& call,
               absl::Time deadline, const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the steps of `run` past their timeout that not every rank reached (ABORTED to their
  // callers).
  static void DropExpired(Run& run, absl::Time now);
  static void End(Run& run, int64_t step, const std::shared_ptr<Pending>& pending,
                  const absl::Status& status);
  static std::string Timeout(const Run& run, int64_t step, const Pending& pending);

  absl::Mutex mu_;
  // By owner. An entry lives as long as the layer (one per caller identity that ran
  // data-parallel steps on it: bounded by the tokens file, or the hosts on loopback).
  std::map<std::string, Run> runs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_DATA_PARALLEL_STEPS_H_
