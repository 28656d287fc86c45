// WorkerPool::ForEachWorker (server/worker_pool.h): one call fanned out to every worker of a
// set at once, and what its failures say about the workers.
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/worker_pool.h"

namespace moe {
namespace {

// gRPC's own failures of a call: the answer never came. ABORTED is not one of them (gRPC does
// not produce it; the engine answers it on the ranks that learnt another rank failed, e.g. a
// checkpoint file that did not verify), so such an answer is a plain failure on every rank.
bool IsTransport(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kCancelled;
}

// How often a fan-out polls its cancellation predicate.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(20);

// Runs call(r) for every rank r < n at once, rank 0 on this thread and the others on `kept`;
// with `cancelled` (rare: drains), every rank on its own new thread while this one polls the
// predicate and cancels every context once it holds.
void CallEveryRank(int n, const std::function<void(int)>& call,
                   const std::function<bool()>& cancelled, const std::function<void()>& cancel_all,
                   KeptThreads* kept) {
  if (cancelled == nullptr) {
    kept->Run(n, [&](size_t r) { call(static_cast<int>(r)); });
    return;
  }
  // Every rank on its own thread; this one watches the predicate.
  absl::Mutex done_mu;
  int done = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      call(r);
      absl::MutexLock lock(&done_mu);
      ++done;
    });
  }
  {
    bool cancelled_once = false;
    absl::MutexLock lock(&done_mu);
    auto all_done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(done_mu) { return done == n; };
    while (!done_mu.AwaitWithTimeout(absl::Condition(&all_done), kCancelPoll)) {
      if (!cancelled_once && cancelled()) {
        cancelled_once = true;
        cancel_all();
      }
    }
  }
  for (std::thread& t : threads) t.join();
}

// The most telling error of a failed fan-out: a worker's own (DATA_LOSS naming a file) before
// ABORTED (another rank failed) before a transport failure, prefixed by its rank; a transport
// failure once the deadline passed is DEADLINE_EXCEEDED.
absl::Status MostTellingError(const std::vector<absl::Status>& results, absl::Time deadline) {
  auto rank_of = [](absl::StatusCode code) {
    return IsTransport(code) ? 2 : code == absl::StatusCode::kAborted ? 1 : 0;
  };
  int pick = -1;
  for (int r = 0; r < static_cast<int>(results.size()); ++r) {
    if (!results[r].ok() &&
        (pick < 0 || rank_of(results[r].code()) < rank_of(results[pick].code()))) {
      pick = r;
    }
  }
  if (absl::Now() >= deadline && IsTransport(results[pick].code())) {
    return absl::DeadlineExceededError(
        absl::StrCat("workers did not answer within the deadline: ", results[pick].message()));
  }
  return absl::Status(results[pick].code(),
                      absl::StrCat("worker ", pick, ": ", results[pick].message()));
}

}  // namespace

absl::Status WorkerPool::ForEachWorker(const WorkerSet& set, absl::Time deadline,
                                       const WorkerFn& fn, bool collective, bool* partial) {
  FanOutOptions options;
  options.collective = collective;
  FanOutOutcome outcome;
  absl::Status status = ForEachWorker(set, deadline, fn, options, &outcome);
  if (partial != nullptr) *partial = outcome.partial;
  return status;
}

absl::Status WorkerPool::NotServingLocked(const WorkerSet& set) const {
  if (generation_ != set.generation || !(serving_ || in_setup_)) {
    return absl::UnavailableError(absl::StrCat("not serving: ", message_));
  }
  return absl::OkStatus();
}

absl::Status WorkerPool::StartCalls(const WorkerSet& set, absl::Time deadline,
                                    std::vector<std::unique_ptr<grpc::ClientContext>>* contexts) {
  absl::MutexLock lock(&mu_);
  absl::Status serving = NotServingLocked(set);
  if (!serving.ok()) return serving;
  for (auto& context : *contexts) {
    context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(absl::ToChronoTime(deadline));
    in_flight_.insert(context.get());
  }
  return absl::OkStatus();
}

void WorkerPool::EndCalls(const std::vector<std::unique_ptr<grpc::ClientContext>>& contexts) {
  absl::MutexLock lock(&mu_);
  for (auto& context : contexts) {
    in_flight_.erase(context.get());
    cancelled_.erase(context.get());
  }
}

WorkerPool::FanOutFailures WorkerPool::CountFailures(const WorkerSet& set,
                                                     const std::vector<absl::Status>& results,
                                                     const std::vector<absl::Time>& ended,
                                                     absl::Time deadline) {
  FanOutFailures failures;
  std::vector<int> to_ping;
  for (int r = 0; r < set.size(); ++r) {
    if (results[r].ok()) continue;
    ++failures.failed;
    if (!IsTransport(results[r].code())) continue;
    ++failures.transport;
    if (results[r].code() == absl::StatusCode::kDeadlineExceeded && ended[r] >= deadline) {
      // The call ran to its deadline: a quick ping would only time out as well on a worker
      // that is stopped, swapping or cut off (and delay the caller's error by the ping), and a
      // worker that died answers calls with UNAVAILABLE, not silence. So the heartbeat alone
      // decides: dead once it heard nothing for --worker_dead_after_ms, else a slow worker,
      // like one that answers, still busy with the call (or just finished it).
      const absl::Duration silent = SilentFor(r);
      if (silent >= options_.dead_after) {
        MarkDead(r, absl::StrCat("call failed (", results[r].message(),
                                 ") and no answer to pings for ", absl::FormatDuration(silent)));
      } else {
        ++failures.overdue;
      }
      continue;
    }
    to_ping.push_back(r);
  }
  // Other connection-level failures: is the worker itself gone? Refused or reset: yes. A ping
  // that times out means a worker that does not answer now: dead only once the heartbeat heard
  // nothing from it for --worker_dead_after_ms. No ping once `set` is no longer served (a
  // death or re-formation cancelled the calls: the caller's error is UNAVAILABLE anyway); the
  // pings run at once, so the caller waits for one --ping_timeout_ms at most.
  if (to_ping.empty() || !CheckWorkersOf(set).ok()) return failures;
  std::vector<absl::Status> pings(to_ping.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < to_ping.size(); ++i) {
    threads.emplace_back(
        [&, i] { pings[i] = QuickPing(set.stubs[to_ping[i]].get(), options_.ping_timeout); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < to_ping.size(); ++i) {
    const int r = to_ping[i];
    if (!pings[i].ok() && (pings[i].code() != absl::StatusCode::kDeadlineExceeded ||
                           SilentFor(r) >= options_.dead_after)) {
      MarkDead(r, absl::StrCat("call failed (", results[r].message(),
                               ") and the worker does not answer pings"));
    }
  }
  return failures;
}

absl::Duration WorkerPool::SilentFor(int rank) const {
  absl::MutexLock lock(&mu_);
  return absl::Now() - slots_[rank].last_seen;
}

absl::Status WorkerPool::CheckWorkersOf(const WorkerSet& set) const {
  absl::MutexLock lock(&mu_);
  for (int r = 0; r < set.size(); ++r) {
    if (!slots_[r].alive) {
      return absl::UnavailableError(
          absl::StrCat("worker ", r, " (", slots_[r].address, ") gone: ", slots_[r].error));
    }
  }
  return NotServingLocked(set);
}

absl::Status WorkerPool::ForEachWorker(const WorkerSet& set, absl::Time deadline,
                                       const WorkerFn& fn, const FanOutOptions& options,
                                       FanOutOutcome* outcome) {
  *outcome = FanOutOutcome();
  const int n = set.size();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(n);
  absl::Status started = StartCalls(set, deadline, &contexts);
  if (!started.ok()) return started;
  std::vector<absl::Status> results(n);
  std::vector<absl::Time> ended(n);
  CallEveryRank(
      n,
      [&](int r) {
        results[r] = fn(r, set.stubs[r].get(), contexts[r].get());
        ended[r] = absl::Now();
      },
      options.cancelled, [&] { CancelCalls(contexts); }, &fan_out_threads_);
  EndCalls(contexts);
  NoteAnswered(set, results, ended);

  const FanOutFailures failures = CountFailures(set, results, ended, deadline);
  if (failures.failed == 0) return absl::OkStatus();
  outcome->partial = failures.failed < n || failures.transport > 0;
  outcome->overdue = failures.overdue > 0;
  absl::Status workers = CheckWorkersOf(set);
  if (!workers.ok()) return workers;
  if (failures.overdue == failures.failed) {
    // Only slow, not broken: the ranks finish the call by themselves (a collective's ranks
    // all run it to its end, or fail it alike after --collective_timeout_ms).
    return absl::DeadlineExceededError(
        absl::StrCat("the workers did not finish within the deadline (", failures.overdue, " of ",
                     n, " still running it; they finish it and its result is dropped)"));
  }
  if (options.collective && (failures.failed < n || failures.transport > 0)) {
    // Logged: a re-formation of live workers should be rare and explainable.
    std::string ranks;
    for (int r = 0; r < n; ++r) {
      absl::StrAppend(&ranks, " rank ", r, ": ", absl::StatusCodeToString(results[r].code()),
                      results[r].ok() ? "" : absl::StrCat(" (", results[r].message(), ")"),
                      ", ended ", absl::FormatDuration(ended[r] - deadline),
                      " after the deadline;");
    }
    std::fprintf(stderr, "moed: a collective call failed on some workers, re-forming:%s\n",
                 ranks.c_str());
    Restart("a collective call failed on some workers");
  }
  return MostTellingError(results, deadline);
}

}  // namespace moe
