// A peer that dies (or stops responding) in the middle of an expert-parallel step makes every
// other rank return an error within its communicator timeout instead of hanging, and every
// later step fails at once. The victim runs the real Gloo communicator behind a wrapper that
// ends the process at the start of its n-th collective call, so the death lands at a chosen
// point of the step: the loss all-reduce, the count all-gather, the dispatch or combine
// all-to-all, or the backward's gate all-reduce.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/comm/file_kv_store.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "tests/ep/ep_cases.h"
#include "tests/harness/multiprocess.h"

namespace moe {
namespace ep_test {
namespace {

using harness::ReadResult;
using harness::WorkerContext;
using harness::WriteResult;

// Forwards every call to a real communicator; at the start of call number `fail_at`
// (0-based, counting every collective) the process exits as a crash would (mode "exit"), or
// stops responding for `hang` and then exits (mode "hang").
class FailingCommunicator : public Communicator {
 public:
  FailingCommunicator(std::unique_ptr<Communicator> inner, int fail_at, std::string mode,
                      absl::Duration hang)
      : inner_(std::move(inner)), fail_at_(fail_at), mode_(std::move(mode)), hang_(hang) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  MemorySpace memory_space() const override { return inner_->memory_space(); }
  std::string name() const override { return inner_->name(); }
  absl::Status AllReduceSum(void* data, size_t count, DType dtype) override {
    MaybeFail("AllReduceSum");
    return inner_->AllReduceSum(data, count, dtype);
  }
  absl::Status AllGather(const void* send, void* recv, size_t bytes) override {
    MaybeFail("AllGather");
    return inner_->AllGather(send, recv, bytes);
  }
  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_bytes, void* recv,
                         absl::Span<const size_t> recv_bytes) override {
    MaybeFail("AllToAllV");
    return inner_->AllToAllV(send, send_bytes, recv, recv_bytes);
  }
  absl::Status Barrier() override {
    MaybeFail("Barrier");
    return inner_->Barrier();
  }

 private:
  void MaybeFail(const char* call) {
    if (calls_++ != fail_at_) return;
    std::fprintf(stderr, "victim: %s at collective %d (%s)\n", mode_.c_str(), fail_at_, call);
    std::fflush(stderr);
    if (mode_ == "hang") {
      absl::SleepFor(hang_);
      std::_Exit(4);
    }
    std::_Exit(3);
  }

  std::unique_ptr<Communicator> inner_;
  const int fail_at_;
  const std::string mode_;
  const absl::Duration hang_;
  int calls_ = 0;
};

// Up to 4 training steps at EP = ctx.size; the first failure is reported in the file
// "failure": "<step> <code> <ms the failing call took> <code of the next forward> <its ms>".
MOED_WORKER(ep_fault, const WorkerContext& ctx) {
  auto store = FileKeyValueStore::Create(ctx.store_dir);
  if (!store.ok()) return store.status();
  CommOptions options;
  options.timeout = absl::Milliseconds(ctx.IntParam("timeout_ms", 3000));
  auto gloo = MakeGlooCommunicator(*store, "ep_fault", ctx.rank, ctx.size, options,
                                   GlooTransportOptions{"", "127.0.0.1"});
  if (!gloo.ok()) return gloo.status();
  std::unique_ptr<Communicator> comm = std::move(*gloo);
  // A rank may leave the rendezvous before its peers have finished theirs; a victim dying
  // right away would then fail a peer's connect, not its step. Start the count after this.
  if (absl::Status s = comm->Barrier(); !s.ok()) return s;
  if (ctx.rank == ctx.IntParam("victim", -1)) {
    comm = std::make_unique<FailingCommunicator>(
        std::move(comm), static_cast<int>(ctx.IntParam("fail_at", 0)), ctx.Param("mode", "exit"),
        absl::Milliseconds(ctx.IntParam("hang_ms", 0)));
  }
  const EpCase c = EpCases(ctx.size)[0];
  const std::vector<int64_t> offsets = SliceOffsets(c, ctx.size);
  const int64_t begin = offsets[ctx.rank], end = offsets[ctx.rank + 1];
  const Tensor x = CaseRows(c, CaseInput(c), begin, end);
  const Tensor d_out = CaseRows(c, CaseOutputGradient(c), begin, end);
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  auto layer = MoeLayer::Create(c.config, backend.get(), comm.get());
  if (!layer.ok()) return layer.status();

  for (int step = 0; step < 4; ++step) {
    const absl::Time start = absl::Now();
    std::unique_ptr<StepContext> saved;
    absl::Status status = (*layer)->Forward(x, &saved).status();
    if (status.ok()) status = (*layer)->Backward(*saved, d_out, 1.0, 1.0).status();
    if (status.ok()) continue;
    const int64_t failed_ms = absl::ToInt64Milliseconds(absl::Now() - start);
    const absl::Time again_start = absl::Now();
    const absl::Status again = (*layer)->Forward(x, nullptr).status();
    const int64_t again_ms = absl::ToInt64Milliseconds(absl::Now() - again_start);
    std::fprintf(stderr, "step %d failed after %lld ms: %s\nnext forward after %lld ms: %s\n", step,
                 static_cast<long long>(failed_ms), status.ToString().c_str(),
                 static_cast<long long>(again_ms), again.ToString().c_str());
    return WriteResult(
        ctx, "failure",
        absl::StrCat(step, " ", absl::StatusCodeToString(status.code()), " ", failed_ms, " ",
                     absl::StatusCodeToString(again.code()), " ", again_ms));
  }
  return absl::InternalError("every step succeeded");
}

struct Failure {
  int step = -1;
  std::string code;
  int64_t ms = -1;
  std::string next_code;
  int64_t next_ms = -1;
};

Failure ParseFailure(const std::string& text) {
  Failure f;
  char code[64] = {0}, next[64] = {0};
  long long ms = -1, next_ms = -1;
  if (std::sscanf(text.c_str(), "%d %63s %lld %63s %lld", &f.step, code, &ms, next, &next_ms) ==
      5) {
    f.code = code;
    f.ms = ms;
    f.next_code = next;
    f.next_ms = next_ms;
  }
  return f;
}

// One step at EP=4 makes 8 collective calls: forward loss all-reduce (0), count all-reduce
// (1), row-count all-gather (2), dispatch all-to-all (3), combine all-to-all (4); backward
// dispatch (5), return (6), gate all-reduce (7). 11 is the second step's all-gather.
class EpPeerDiesTest : public ::testing::TestWithParam<int> {};

TEST_P(EpPeerDiesTest, OthersFailWithinTheTimeout) {
  constexpr int kRanks = 4, kVictim = 2, kTimeoutMs = 3000;
  harness::LaunchOptions launch;
  launch.worker = "ep_fault";
  launch.size = kRanks;
  launch.params = {{"victim", std::to_string(kVictim)},
                   {"fail_at", std::to_string(GetParam())},
                   {"timeout_ms", std::to_string(kTimeoutMs)}};
  launch.deadline = absl::Seconds(30);
  auto run = harness::RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->ranks[kVictim].exit_code, 3) << run->Summary();
  for (int r = 0; r < kRanks; ++r) {
    if (r == kVictim) continue;
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_TRUE(run->ranks[r].ok()) << run->Summary();
    auto text = ReadResult(run->ranks[r], "failure");
    ASSERT_TRUE(text.ok()) << run->Summary();
    const Failure f = ParseFailure(*text);
    EXPECT_EQ(f.step, GetParam() / 8) << *text;
    EXPECT_TRUE(f.code == "UNAVAILABLE" || f.code == "DEADLINE_EXCEEDED") << *text;
    EXPECT_LE(f.ms, kTimeoutMs + 1500) << *text;
    EXPECT_EQ(f.next_code, "UNAVAILABLE") << *text;
    EXPECT_LT(f.next_ms, 500) << *text;  // fails fast: the communicator is broken
  }
}

INSTANTIATE_TEST_SUITE_P(FailAt, EpPeerDiesTest, ::testing::Values(0, 2, 3, 4, 5, 7, 10),
                         [](const auto& info) { return absl::StrCat("call", info.param); });

TEST(EpPeerHangsTest, OthersTimeOut) {
  constexpr int kTimeoutMs = 1500;
  harness::LaunchOptions launch;
  launch.worker = "ep_fault";
  launch.size = 2;
  launch.params = {{"victim", "1"},
                   {"fail_at", "3"},
                   {"mode", "hang"},
                   {"hang_ms", "4000"},
                   {"timeout_ms", std::to_string(kTimeoutMs)}};
  launch.deadline = absl::Seconds(30);
  auto run = harness::RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->ranks[1].exit_code, 4) << run->Summary();
  ASSERT_TRUE(run->ranks[0].ok()) << run->Summary();
  auto text = ReadResult(run->ranks[0], "failure");
  ASSERT_TRUE(text.ok()) << run->Summary();
  const Failure f = ParseFailure(*text);
  EXPECT_EQ(f.step, 0) << *text;
  EXPECT_EQ(f.code, "DEADLINE_EXCEEDED") << *text;
  EXPECT_GE(f.ms, kTimeoutMs - 100) << *text;
  EXPECT_LE(f.ms, kTimeoutMs + 1500) << *text;
  EXPECT_EQ(f.next_code, "UNAVAILABLE") << *text;
  EXPECT_LT(f.next_ms, 500) << *text;
}

}  // namespace
}  // namespace ep_test
}  // namespace moe
