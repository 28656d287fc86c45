// Tests of the multi-process harness itself: ranks and parameters arrive, results come back,
// failures, crashes and hangs are each reported as such, and a hang is cut at the deadline.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/harness/multiprocess.h"

namespace moe {
namespace harness {
namespace {

MOED_WORKER(echo_rank, const WorkerContext& ctx) {
  std::vector<int64_t> values = {ctx.rank, ctx.size, ctx.IntParam("base", -1) + ctx.rank};
  std::fprintf(stderr, "hello from rank %d color=%s\n", ctx.rank, ctx.Param("color").c_str());
  if (ctx.store_dir.empty() || ctx.work_dir.empty()) {
    return absl::InternalError("missing directories");
  }
  return WriteResult(ctx, "values", EncodeValues(values));
}

MOED_WORKER(fail_on_rank_one, const WorkerContext& ctx) {
  if (ctx.rank == 1) return absl::UnavailableError("rank one says no");
  return absl::OkStatus();
}

MOED_WORKER(crash_or_hang, const WorkerContext& ctx) {
  const std::string mode = ctx.Param("mode");
  if (mode == "abort") std::abort();
  if (mode == "hang") {
    while (true) absl::SleepFor(absl::Seconds(1));
  }
  if (mode == "exit7") std::_Exit(7);
  return absl::OkStatus();
}

TEST(HarnessTest, RanksParamsAndResults) {
  LaunchOptions launch;
  launch.worker = "echo_rank";
  launch.size = 3;
  launch.params = {{"base", "100"}};
  launch.rank_params[2] = {{"color", "blue"}};
  auto run = RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(run->AllSucceeded()) << run->Summary();
  ASSERT_EQ(run->ranks.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    auto bytes = ReadResult(run->ranks[r], "values");
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto values = DecodeValues<int64_t>(*bytes);
    ASSERT_TRUE(values.ok());
    EXPECT_EQ(*values, (std::vector<int64_t>{r, 3, 100 + r}));
    EXPECT_TRUE(absl::StrContains(run->ranks[r].stderr_text, absl::StrCat("hello from rank ", r)));
  }
  EXPECT_TRUE(absl::StrContains(run->ranks[2].stderr_text, "color=blue"));
  EXPECT_TRUE(absl::StrContains(run->ranks[1].stderr_text, "color=\n"));
  EXPECT_EQ(ReadResult(run->ranks[0], "missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(HarnessTest, WorkerErrorBecomesExitCodeAndMessage) {
  LaunchOptions launch;
  launch.worker = "fail_on_rank_one";
  launch.size = 2;
  auto run = RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_FALSE(run->AllSucceeded());
  EXPECT_TRUE(run->ranks[0].ok()) << run->Summary();
  EXPECT_EQ(run->ranks[1].exit_code, 1);
  EXPECT_TRUE(absl::StrContains(run->ranks[1].stderr_text, "rank one says no"));
  EXPECT_TRUE(absl::StrContains(run->Summary(), "rank 1: exit 1"));
}

TEST(HarnessTest, CrashExitAndHangAreReported) {
  LaunchOptions launch;
  launch.worker = "crash_or_hang";
  launch.size = 4;
  launch.deadline = absl::Seconds(2);
  launch.rank_params[1] = {{"mode", "abort"}};
  launch.rank_params[2] = {{"mode", "hang"}};
  launch.rank_params[3] = {{"mode", "exit7"}};
  const absl::Time start = absl::Now();
  auto run = RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_TRUE(run->ranks[0].ok()) << run->Summary();
  EXPECT_EQ(run->ranks[1].signal, SIGABRT) << run->Summary();
  EXPECT_TRUE(run->ranks[2].killed_at_deadline) << run->Summary();
  EXPECT_EQ(run->ranks[2].signal, SIGKILL);
  EXPECT_EQ(run->ranks[3].exit_code, 7);
  EXPECT_FALSE(run->ranks[3].killed_at_deadline);
}

TEST(HarnessTest, UnknownWorkerFailsEveryRank) {
  LaunchOptions launch;
  launch.worker = "no_such_worker";
  launch.size = 2;
  auto run = RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  for (const RankResult& r : run->ranks) {
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_TRUE(absl::StrContains(r.stderr_text, "no worker named"));
  }
}

TEST(HarnessTest, BadOptionsAreRejected) {
  LaunchOptions launch;
  EXPECT_EQ(RunWorkers(launch).status().code(), absl::StatusCode::kInvalidArgument);
  launch.worker = "echo_rank";
  launch.size = 0;
  EXPECT_EQ(RunWorkers(launch).status().code(), absl::StatusCode::kInvalidArgument);
  launch.size = 1;
  launch.params = {{"bad key", "x"}};
  EXPECT_EQ(RunWorkers(launch).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace harness
}  // namespace moe
