// DataParallelSteps (server/data_parallel_steps.h) without a server: who leads a step, what
// the others get, repeats, timeouts with and without waiting calls, runs, a failed lead.
#include "server/data_parallel_steps.h"

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

const absl::Duration kLong = absl::Seconds(30);

DataParallelCall Call(int rank, int64_t step, int num_ranks = 2, std::string run = "run",
                      std::string owner = "token alice") {
  DataParallelCall call;
  call.owner = std::move(owner);
  call.run_id = std::move(run);
  call.step = step;
  call.num_ranks = num_ranks;
  call.rank = rank;
  call.optimizer = "sgd";
  return call;
}

bool Never() { return false; }

// Arrive on a thread of its own (a rank that waits).
std::future<DataParallelSteps::Arrival> ArriveAsync(DataParallelSteps* steps, DataParallelCall call,
                                                    absl::Duration timeout = kLong) {
  return std::async(std::launch::async,
                    [=] { return steps->Arrive(call, timeout, absl::Now() + kLong, Never); });
}

v1::ApplyOptimizerResponse Answer(int64_t optimizer_step) {
  v1::ApplyOptimizerResponse answer;
  answer.set_optimizer_step(optimizer_step);
  return answer;
}

// Every rank of `step` on a thread of its own; the lead, whichever it is, finishes the step
// with `outcome` / `answer`. Returns the arrivals in rank order.
std::vector<DataParallelSteps::Arrival> RunStep(DataParallelSteps* steps, int64_t step,
                                                int num_ranks, const absl::Status& outcome,
                                                int64_t answer) {
  std::vector<std::future<DataParallelSteps::Arrival>> ranks;
  for (int r = 0; r < num_ranks; ++r) {
    ranks.push_back(std::async(std::launch::async, [=] {
      DataParallelSteps::Arrival arrival =
          steps->Arrive(Call(r, step, num_ranks), kLong, absl::Now() + kLong, Never);
      if (arrival.lead) steps->Finish(Call(r, step, num_ranks), outcome, Answer(answer));
      return arrival;
    }));
  }
  std::vector<DataParallelSteps::Arrival> arrivals;
  for (auto& rank : ranks) arrivals.push_back(rank.get());
  return arrivals;
}

TEST(DataParallelStepsTest, OneRankLeadsAndTheOthersGetItsAnswer) {
  DataParallelSteps steps;
  std::vector<DataParallelSteps::Arrival> arrivals = RunStep(&steps, 0, 3, absl::OkStatus(), 7);
  int leads = 0;
  for (const DataParallelSteps::Arrival& arrival : arrivals) {
    if (arrival.lead) {
      ++leads;
      continue;
    }
    ASSERT_TRUE(arrival.status.ok()) << arrival.status;
    EXPECT_EQ(arrival.answer.optimizer_step(), 7);
    EXPECT_FALSE(arrival.answer.already_applied());
  }
  EXPECT_EQ(leads, 1);
  // A repeat of the applied step: the recorded answer, no lead.
  DataParallelSteps::Arrival repeat = steps.Arrive(Call(0, 0, 3), kLong, absl::Now(), Never);
  EXPECT_FALSE(repeat.lead);
  EXPECT_TRUE(repeat.status.ok());
  EXPECT_TRUE(repeat.answer.already_applied());
  EXPECT_EQ(repeat.answer.optimizer_step(), 7);
}

TEST(DataParallelStepsTest, ARankCountsOnce) {
  DataParallelSteps steps;
  DataParallelSteps::Arrival gave_up =
      steps.Arrive(Call(0, 4), kLong, absl::Now() + absl::Milliseconds(50), Never);
  EXPECT_TRUE(absl::IsDeadlineExceeded(gave_up.status)) << gave_up.status;
  auto again = ArriveAsync(&steps, Call(0, 4));  // the same rank: still waits for rank 1
  EXPECT_EQ(again.wait_for(std::chrono::milliseconds(150)), std::future_status::timeout);
  DataParallelSteps::Arrival last = steps.Arrive(Call(1, 4), kLong, absl::Now() + kLong, Never);
  ASSERT_TRUE(last.lead);
  steps.Finish(Call(1, 4), absl::OkStatus(), Answer(1));
  EXPECT_TRUE(again.get().status.ok());
}

TEST(DataParallelStepsTest, AStepNotEveryRankReachedIsDroppedAtItsTimeout) {
  DataParallelSteps steps;
  const absl::Time start = absl::Now();
  DataParallelSteps::Arrival alone =
      steps.Arrive(Call(0, 1, 4), absl::Milliseconds(200), absl::Now() + kLong, Never);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  EXPECT_TRUE(absl::IsAborted(alone.status)) << alone.status;
  EXPECT_THAT(alone.status.message(), HasSubstr("missing ranks: 1, 2, 3"));
  // Expired with nobody waiting (the caller's own deadline came first): the next call sees it
  // dropped and gathers anew, so the late rank waits for a new set of ranks.
  DataParallelSteps::Arrival early = steps.Arrive(Call(0, 2), absl::Milliseconds(100),
                                                  absl::Now() + absl::Milliseconds(20), Never);
  EXPECT_TRUE(absl::IsDeadlineExceeded(early.status));
  absl::SleepFor(absl::Milliseconds(150));
  DataParallelSteps::Arrival late =
      steps.Arrive(Call(1, 2), kLong, absl::Now() + absl::Milliseconds(50), Never);
  EXPECT_FALSE(late.lead);  // rank 0's expired call no longer counts
  EXPECT_TRUE(absl::IsDeadlineExceeded(late.status)) << late.status;
}

TEST(DataParallelStepsTest, AFailedLeadIsNotRecorded) {
  DataParallelSteps steps;
  for (const auto& arrival : RunStep(&steps, 3, 2, absl::UnavailableError("worker gone"), 0)) {
    if (!arrival.lead) {
      EXPECT_TRUE(absl::IsUnavailable(arrival.status)) << arrival.status;
    }
  }
  // The step can be gathered again (it was not recorded as applied).
  for (const auto& arrival : RunStep(&steps, 3, 2, absl::OkStatus(), 1)) {
    if (!arrival.lead) {
      EXPECT_TRUE(arrival.status.ok()) << arrival.status;
      EXPECT_FALSE(arrival.answer.already_applied());
    }
  }
}

TEST(DataParallelStepsTest, RunsAndOldSteps) {
  DataParallelSteps steps;
  for (int64_t step = 0; step < kAppliedStepsKept + 2; ++step) {
    RunStep(&steps, step, 2, absl::OkStatus(), step + 1);
  }
  // The oldest steps are no longer recorded: refused, not applied again.
  DataParallelSteps::Arrival old = steps.Arrive(Call(0, 0), kLong, absl::Now(), Never);
  EXPECT_TRUE(absl::IsFailedPrecondition(old.status)) << old.status;
  EXPECT_TRUE(steps.Arrive(Call(0, 2), kLong, absl::Now(), Never).answer.already_applied());
  // Another run while a step is pending is refused; once none is, it starts afresh at step 0.
  auto pending = ArriveAsync(&steps, Call(0, 100));
  absl::SleepFor(absl::Milliseconds(50));
  DataParallelSteps::Arrival other =
      steps.Arrive(Call(0, 0, 2, "other"), kLong, absl::Now(), Never);
  EXPECT_TRUE(absl::IsFailedPrecondition(other.status)) << other.status;
  EXPECT_THAT(other.status.message(), HasSubstr("run_id"));
  steps.AbortAll(absl::NotFoundError("layer deleted"));
  EXPECT_TRUE(absl::IsNotFound(pending.get().status));
  EXPECT_TRUE(steps.Arrive(Call(1, 0, 2, "other"), kLong, absl::Now(), Never).status.code() ==
              absl::StatusCode::kDeadlineExceeded);  // waits for rank 0 of the new run
}

TEST(DataParallelStepsTest, ParseRefusesFieldsOutOfRange) {
  DataParallelCall call;
  v1::ApplyOptimizerRequest request;
  request.mutable_sgd()->set_lr(0.1);
  request.set_num_ranks(2);
  request.set_rank(1);
  request.set_step(5);
  request.set_run_id("r");
  ASSERT_TRUE(ParseDataParallelCall(request, "token alice", kMaxDataParallelRanks, &call).ok());
  EXPECT_EQ(call.rank, 1);
  EXPECT_EQ(call.step, 5);
  EXPECT_EQ(call.owner, "token alice");
  // moed --max_dp_ranks bounds num_ranks below kMaxDataParallelRanks.
  v1::ApplyOptimizerRequest wide = request;
  wide.set_num_ranks(1025);
  EXPECT_TRUE(ParseDataParallelCall(wide, "token alice", 1025, &call).ok());
  absl::Status refused = ParseDataParallelCall(wide, "token alice", 1024, &call);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("--max_dp_ranks"));
  v1::ApplyOptimizerRequest other = request;
  other.mutable_sgd()->set_lr(0.2);
  DataParallelCall other_call;
  ASSERT_TRUE(ParseDataParallelCall(other, "token alice", kMaxDataParallelRanks, &other_call).ok());
  EXPECT_NE(call.optimizer, other_call.optimizer);
  struct Case {
    void (*change)(v1::ApplyOptimizerRequest*);
    const char* field;
  };
  for (const Case& c : std::vector<Case>{
           {[](v1::ApplyOptimizerRequest* r) { r->set_num_ranks(1); }, "num_ranks"},
           {[](v1::ApplyOptimizerRequest* r) { r->set_num_ranks(kMaxDataParallelRanks + 1); },
            "num_ranks"},
           {[](v1::ApplyOptimizerRequest* r) { r->set_rank(2); }, "rank"},
           {[](v1::ApplyOptimizerRequest* r) { r->set_rank(-1); }, "rank"},
           {[](v1::ApplyOptimizerRequest* r) { r->set_step(-1); }, "step"},
           {[](v1::ApplyOptimizerRequest* r) { r->set_run_id(std::string(257, 'x')); },
            "run_id"}}) {
    v1::ApplyOptimizerRequest bad = request;
    c.change(&bad);
    absl::Status status = ParseDataParallelCall(bad, "token alice", kMaxDataParallelRanks, &call);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << c.field;
    EXPECT_THAT(status.message(), HasSubstr(c.field));
  }
}

TEST(DataParallelStepsTest, ARunAnswersOnlyItsOwner) {
  DataParallelSteps steps;
  auto rank0 = ArriveAsync(&steps, Call(0, 0, 2, "run", "token alice"));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Another identity naming alice's run: refused at once, and its rank does not count.
  DataParallelSteps::Arrival intruder =
      steps.Arrive(Call(1, 0, 2, "run", "token mallory"), kLong, absl::Now() + kLong, Never);
  EXPECT_FALSE(intruder.lead);
  EXPECT_TRUE(absl::IsPermissionDenied(intruder.status)) << intruder.status;
  EXPECT_EQ(rank0.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  // Alice's own rank 1 completes the step.
  DataParallelSteps::Arrival rank1 =
      steps.Arrive(Call(1, 0, 2, "run", "token alice"), kLong, absl::Now() + kLong, Never);
  ASSERT_TRUE(rank1.lead);
  steps.Finish(Call(1, 0, 2, "run", "token alice"), absl::OkStatus(), Answer(1));
  EXPECT_TRUE(rank0.get().status.ok());
  // Still hers once nothing is pending: mallory cannot read or replace its record either.
  EXPECT_TRUE(absl::IsPermissionDenied(
      steps.Arrive(Call(0, 0, 2, "run", "token mallory"), kLong, absl::Now(), Never).status));
}

TEST(DataParallelStepsTest, OneCallersPendingRunNeverBlocksAnothersRun) {
  DataParallelSteps steps;
  // Alice declares 1024 ranks and sends one: her step stays pending.
  auto alice = ArriveAsync(&steps, Call(0, 0, 1024, "alice-run", "token alice"));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Bob's run on the same layer steps meanwhile, twice.
  for (int64_t step = 0; step < 2; ++step) {
    std::vector<std::future<DataParallelSteps::Arrival>> bob;
    for (int r = 0; r < 2; ++r) {
      bob.push_back(std::async(std::launch::async, [&steps, r, step] {
        const DataParallelCall call = Call(r, step, 2, "bob-run", "token bob");
        DataParallelSteps::Arrival arrival = steps.Arrive(call, kLong, absl::Now() + kLong, Never);
        if (arrival.lead) steps.Finish(call, absl::OkStatus(), Answer(step + 1));
        return arrival;
      }));
    }
    int leads = 0;
    for (auto& rank : bob) {
      DataParallelSteps::Arrival arrival = rank.get();
      ASSERT_TRUE(arrival.status.ok()) << arrival.status;
      if (arrival.lead) {
        ++leads;
      } else {
        EXPECT_EQ(arrival.answer.optimizer_step(), step + 1);
      }
    }
    EXPECT_EQ(leads, 1);
  }
  // Alice's second run waits for her first, as before (one run per caller at a time).
  EXPECT_TRUE(absl::IsFailedPrecondition(
      steps.Arrive(Call(0, 0, 2, "alice-other", "token alice"), kLong, absl::Now(), Never).status));
  steps.AbortAll(absl::NotFoundError("layer deleted"));
  EXPECT_TRUE(absl::IsNotFound(alice.get().status));
}

}  // namespace
}  // namespace moe
