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
                                   DataParallelCall* call) {
  if (request.num_ranks() < 2 || request.num_ranks() > kMaxDataParallelRanks) {
    return absl::InvalidArgumentError(absl::StrCat("num_ranks: a data-parallel step has 2 to ",
                                                   kMaxDataParallelRanks, " ranks, got ",
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
  return Wait(pending, call, deadline, cancelled);
}

absl::Status DataParallelSteps::Admit(const DataParallelCall& call, absl::Duration step_timeout,
                                      std::shared_ptr<Pending>* pending, Arrival* recorded) {
  const absl::Time now = absl::Now();
  DropExpired(now);
  if (call.run_id != run_id_) {
    if (!pending_.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "run_id: \"", call.run_id, "\" while step ", pending_.begin()->first, " of run \"",
          run_id_, "\" is pending: a layer serves one data-parallel run at a time"));
    }
    run_id_ = call.run_id;  // a new run: the old one's record goes
    applied_.clear();
    last_applied_ = -1;
  }
  if (auto it = applied_.find(call.step); it != applied_.end()) {
    recorded->answer = it->second;
    recorded->answer.set_already_applied(true);
    return absl::OkStatus();
  }
  if (call.step <= last_applied_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: ", call.step, " is older than step ", last_applied_, " of run \"", run_id_,
        "\", already applied, and no longer recorded (the last ", kAppliedStepsKept, " are)"));
  }
  std::shared_ptr<Pending>& slot = pending_[call.step];
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

DataParallelSteps::Arrival DataParallelSteps::Wait(const std::shared_ptr<Pending>& pending,
                                                   const DataParallelCall& call,
                                                   absl::Time deadline,
                                                   const std::function<bool()>& cancelled) {
  Arrival arrival;
  while (!pending->done) {
    const absl::Time now = absl::Now();
    if (!pending->leading && now >= pending->expires) {
      End(call.step, pending, absl::AbortedError(Timeout(call.step, *pending)));
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
  auto it = pending_.find(call.step);
  if (it == pending_.end()) return;  // aborted meanwhile (layer deleted)
  std::shared_ptr<Pending> pending = it->second;
  pending->answer = answer;
  End(call.step, pending, status);
  if (!status.ok()) return;
  applied_[call.step] = answer;
  last_applied_ = std::max(last_applied_, call.step);
  while (static_cast<int>(applied_.size()) > kAppliedStepsKept) applied_.erase(applied_.begin());
}

void DataParallelSteps::AbortAll(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  while (!pending_.empty()) {
    auto first = pending_.begin();
    End(first->first, first->second, why);
  }
}

void DataParallelSteps::DropExpired(absl::Time now) {
  std::vector<int64_t> expired;
  for (const auto& [step, pending] : pending_) {
    if (!pending->leading && now >= pending->expires) expired.push_back(step);
  }
  for (int64_t step : expired) {
    std::shared_ptr<Pending> pending = pending_[step];
    End(step, pending, absl::AbortedError(Timeout(step, *pending)));
  }
}

void DataParallelSteps::End(int64_t step, const std::shared_ptr<Pending>& pending,
                            const absl::Status& status) {
  pending->done = true;
  pending->status = status;
  auto it = pending_.find(step);
  if (it != pending_.end() && it->second == pending) pending_.erase(it);
}

std::string DataParallelSteps::Timeout(int64_t step, const Pending& pending) const {
  std::vector<int> missing;
  for (int r = 0; r < pending.num_ranks && missing.size() < 16; ++r) {
    if (pending.ranks.count(r) == 0) missing.push_back(r);
  }
  const bool more_missing =
      pending.num_ranks - static_cast<int>(pending.ranks.size()) > static_cast<int>(missing.size());
  return absl::StrCat("step ", step, " of run \"", run_id_, "\": only ", pending.ranks.size(),
                      " of ", pending.num_ranks,
                      " ranks called ApplyOptimizer within --dp_step_timeout_ms (missing ranks: ",
                      absl::StrJoin(missing, ", "), more_missing ? ", ..." : "",
                      "); the step is dropped, the gradients stay accumulated");
}

}  // namespace moe
