#include "server/data_parallel_steps.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe {
namespace {

// How often a waiting call looks at its client's cancellation.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

std::string OptimizerBytes(const v1::ApplyOptimizerRequest& request) {
  // Only the optimizer (a message without maps serialises the same bytes for equal values).
  v1::ApplyOptimizerRequest only;
  if (request.has_sgd()) *only.mutable_sgd() = request.sgd();
  if (request.has_adamw()) *only.mutable_adamw() = request.adamw();
  return only.SerializeAsString();
}

}  // namespace

absl::Status ParseDataParallelCall(const v1::ApplyOptimizerRequest& request,
                                   const std::string& owner, int max_ranks,
                                   DataParallelCall* call) {
  max_ranks = std::min(max_ranks, kMaxDataParallelRanks);
  if (request.num_ranks() < 2 || request.num_ranks() > max_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("num_ranks: a data-parallel step has 2 to ",
                                                   max_ranks, " ranks (moed --max_dp_ranks), got ",
                                                   request.num_ranks()));
  }
  if (request.rank() < 0 || request.rank() >= request.num_ranks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank: must be in [0, num_ranks = ", request.num_ranks(), "), got ", request.rank()));
  }
  if (request.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step: must be >= 0, got ", request.step()));
  }
  if (request.run_id().size() > kMaxRunIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("run_id: at most ", kMaxRunIdBytes, " bytes, got ", request.run_id().size()));
  }
  call->owner = owner;
  call->run_id = request.run_id();
  call->step = request.step();
  call->num_ranks = request.num_ranks();
  call->rank = request.rank();
  call->optimizer = OptimizerBytes(request);
  return absl::OkStatus();
}

DataParallelSteps::Arrival DataParallelSteps::Arrive(const DataParallelCall& call,
                                                     absl::Duration step_timeout,
                                                     absl::Time deadline,
                                                     const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Pending> pending;
  Arrival arrival;
  arrival.status = Admit(call, step_timeout, &pending, &arrival);
  if (!arrival.status.ok() || pending == nullptr) return arrival;  // refused, or recorded
  pending->ranks.insert(call.rank);
  if (!pending->leading && static_cast<int>(pending->ranks.size()) == pending->num_ranks) {
    pending->leading = true;
    arrival.lead = true;
    return arrival;
  }
  return Wait(runs_[call.owner], pending, call, deadline, cancelled);
}

absl::Status DataParallelSteps::Admit(const DataParallelCall& call, absl::Duration step_timeout,
                                      std::shared_ptr<Pending>* pending, Arrival* recorded) {
  const absl::Time now = absl::Now();
  for (auto& [owner, run] : runs_) {
    DropExpired(run, now);
    if (owner != call.owner && run.run_id == call.run_id) {
      return absl::PermissionDeniedError(absl::StrCat(
          "run_id: \"", call.run_id,
          "\" is a data-parallel run another caller opened on this layer; a run answers only "
          "the identity (bearer token) that opened it: draw a run_id of your own"));
    }
  }
  Run& run = runs_[call.owner];
  if (call.run_id != run.run_id) {
    if (!run.pending.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("run_id: \"", call.run_id, "\" while step ", run.pending.begin()->first,
                       " of your run \"", run.run_id,
                       "\" is pending: a caller runs one data-parallel run at a time on a layer"));
    }
    run = Run();  // a new run: the old one's record goes
    run.run_id = call.run_id;
  }
  if (auto it = run.applied.find(call.step); it != run.applied.end()) {
    recorded->answer = it->second;
    recorded->answer.set_already_applied(true);
    return absl::OkStatus();
  }
  if (call.step <= run.last_applied) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: ", call.step, " is older than step ", run.last_applied, " of run \"", run.run_id,
        "\", already applied, and no longer recorded (the last ", kAppliedStepsKept, " are)"));
  }
  std::shared_ptr<Pending>& slot = run.pending[call.step];
  if (slot == nullptr) {
    slot = std::make_shared<Pending>();
    slot->num_ranks = call.num_ranks;
    slot->optimizer = call.optimizer;
    slot->expires = now + step_timeout;
  } else if (slot->num_ranks != call.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("num_ranks: ", call.num_ranks, " but step ",
                                                   call.step, " was first called with ",
                                                   slot->num_ranks));
  } else if (slot->optimizer != call.optimizer) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer: differs from the one step ", call.step, " was first called with"));
  }
  *pending = slot;
  return absl::OkStatus();
}

DataParallelSteps::Arrival DataParallelSteps::Wait(Run& run,
                                                   const std::shared_ptr<Pending>& pending,
                                                   const DataParallelCall& call,
                                                   absl::Time deadline,
                                                   const std::function<bool()>& cancelled) {
  Arrival arrival;
  while (!pending->done) {
    const absl::Time now = absl::Now();
    if (!pending->leading && now >= pending->expires) {
      End(run, call.step, pending, absl::AbortedError(Timeout(run, call.step, *pending)));
      break;
    }
    if (cancelled()) {
      arrival.status = absl::CancelledError("client cancelled");
      return arrival;
    }
    if (now >= deadline) {
      arrival.status = absl::DeadlineExceededError(absl::StrCat(
          "deadline passed while waiting for the other ranks of step ", call.step, " (",
          pending->ranks.size(), " of ", pending->num_ranks, " called; this call still counts)"));
      return arrival;
    }
    absl::Time until = std::min(deadline, now + kCancelPoll);
    if (!pending->leading) until = std::min(until, pending->expires);
    mu_.AwaitWithDeadline(absl::Condition(&pending->done), until);
  }
  arrival.status = pending->status;
  if (arrival.status.ok()) arrival.answer = pending->answer;
  return arrival;
}

void DataParallelSteps::Finish(const DataParallelCall& call, const absl::Status& status,
                               const v1::ApplyOptimizerResponse& answer) {
  absl::MutexLock lock(&mu_);
  auto found = runs_.find(call.owner);
  if (found == runs_.end()) return;
  Run& run = found->second;
  auto it = run.pending.find(call.step);
  if (it == run.pending.end()) return;  // aborted meanwhile (layer deleted)
  std::shared_ptr<Pending> pending = it->second;
  pending->answer = answer;
  End(run, call.step, pending, status);
  if (!status.ok()) return;
  run.applied[call.step] = answer;
  run.last_applied = std::max(run.last_applied, call.step);
  while (static_cast<int>(run.applied.size()) > kAppliedStepsKept) {
    run.applied.erase(run.applied.begin());
  }
}

void DataParallelSteps::AbortAll(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  for (auto& [owner, run] : runs_) {
    while (!run.pending.empty()) {
      auto first = run.pending.begin();
      End(run, first->first, first->second, why);
    }
  }
}

void DataParallelSteps::DropExpired(Run& run, absl::Time now) {
  std::vector<int64_t> expired;
  for (const auto& [step, pending] : run.pending) {
    if (!pending->leading && now >= pending->expires) expired.push_back(step);
  }
  for (int64_t step : expired) {
    std::shared_ptr<Pending> pending = run.pending[step];
    End(run, step, pending, absl::AbortedError(Timeout(run, step, *pending)));
  }
}

void DataParallelSteps::End(Run& run, int64_t step, const std::shared_ptr<Pending>& pending,
                            const absl::Status& status) {
  pending->done = true;
  pending->status = status;
  auto it = run.pending.find(step);
  if (it != run.pending.end() && it->second == pending) run.pending.erase(it);
}

std::string DataParallelSteps::Timeout(const Run& run, int64_t step, const Pending& pending) {
  std::vector<int> missing;
  for (int r = 0; r < pending.num_ranks && missing.size() < 16; ++r) {
    if (pending.ranks.count(r) == 0) missing.push_back(r);
  }
  const bool more_missing =
      pending.num_ranks - static_cast<int>(pending.ranks.size()) > static_cast<int>(missing.size());
  return absl::StrCat("step ", step, " of run \"", run.run_id, "\": only ", pending.ranks.size(),
                      " of ", pending.num_ranks,
                      " ranks called ApplyOptimizer within --dp_step_timeout_ms (missing ranks: ",
                      absl::StrJoin(missing, ", "), more_missing ? ", ..." : "",
                      "); the step is dropped, the gradients stay accumulated");
}

}  // namespace moe
