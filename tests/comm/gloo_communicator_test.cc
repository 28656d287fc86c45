// Tests of the Gloo communicator: every collective with uneven and zero sizes, in threads of
// one process (in-memory store) and in separate processes (file store, via the harness), and
// the failure paths: a peer that exits or hangs mid-collective, a rank that never shows up,
// bad arguments. Small sizes: each case runs in well under a second on 2 cores, apart from
// the cases that wait out a deliberately short timeout.
#include "engine/comm/gloo_communicator.h"

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/comm/file_kv_store.h"
#include "engine/comm/memory_kv_store.h"
#include "gtest/gtest.h"
#include "tests/harness/multiprocess.h"

namespace moe {
namespace {

using harness::DecodeValues;
using harness::EncodeValues;
using harness::LaunchOptions;
using harness::ReadResult;
using harness::RunWorkers;
using harness::WorkerContext;
using harness::WriteResult;

const GlooTransportOptions kLoopback{"", "127.0.0.1"};

CommOptions Timeout(absl::Duration timeout) {
  CommOptions options;
  options.timeout = timeout;
  return options;
}

// Bytes rank `src` sends to rank `dst` in the all-to-all tests: uneven, some zero.
size_t PairBytes(int src, int dst, int size) { return (src * 3 + dst * 5 + size) % 7; }
uint8_t PairByte(int src, int dst, size_t i) {
  return static_cast<uint8_t>(src * 31 + dst * 7 + i);
}

// Values rank r contributes to the all-reduce tests: float sums that depend on the order.
std::vector<float> FloatInput(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (rank % 2 ? 1e8f : 1.0f) / (1.0f + i + rank * 0.37f);
  return v;
}

// Runs every collective once; checks what can be checked locally and returns the rest
// (all-reduce results, to compare across ranks) in `out`.
absl::Status ExerciseCollectives(Communicator& comm, std::vector<float>* float_sum) {
  const int rank = comm.rank();
  const int size = comm.size();
  // All-reduce, every dtype; 1000 floats span several Gloo ring segments per rank.
  std::vector<float> f = FloatInput(rank, 1000);
  if (absl::Status s = comm.AllReduceSum(f.data(), f.size(), DType::kFloat32); !s.ok()) return s;
  *float_sum = f;
  std::vector<double> d = {0.5 * rank, 1.0, -2.0 * rank};
  if (absl::Status s = comm.AllReduceSum(d.data(), d.size(), DType::kFloat64); !s.ok()) return s;
  const double ranks_sum = size * (size - 1) / 2.0;
  if (d != std::vector<double>{0.5 * ranks_sum, 1.0 * size, -2.0 * ranks_sum}) {
    return absl::InternalError("fp64 all-reduce wrong");
  }
  std::vector<int32_t> i32 = {rank, 1, -rank};
  if (absl::Status s = comm.AllReduceSum(i32.data(), i32.size(), DType::kInt32); !s.ok()) return s;
  const int32_t rs = size * (size - 1) / 2;
  if (i32 != std::vector<int32_t>{rs, size, -rs}) return absl::InternalError("int32 wrong");
  std::vector<int64_t> i64 = {int64_t{1} << 40, rank};
  if (absl::Status s = comm.AllReduceSum(i64.data(), i64.size(), DType::kInt64); !s.ok()) return s;
  if (i64 != std::vector<int64_t>{size * (int64_t{1} << 40), rs}) {
    return absl::InternalError("int64 wrong");
  }
  if (absl::Status s = comm.AllReduceSum(nullptr, 0, DType::kInt64); !s.ok()) return s;

  // All-gather of an odd number of bytes, then of zero bytes.
  std::vector<uint8_t> mine = {uint8_t(rank), uint8_t(rank + 100), uint8_t(rank * 3)};
  std::vector<uint8_t> all(3 * size, 0xee);
  if (absl::Status s = comm.AllGather(mine.data(), all.data(), 3); !s.ok()) return s;
  for (int r = 0; r < size; ++r) {
    if (all[3 * r] != r || all[3 * r + 1] != r + 100 || all[3 * r + 2] != uint8_t(r * 3)) {
      return absl::InternalError(absl::StrCat("all-gather wrong for rank ", r));
    }
  }
  if (absl::Status s = comm.AllGather(nullptr, nullptr, 0); !s.ok()) return s;

  // All-to-all with uneven and zero sizes.
  std::vector<size_t> send_bytes(size), recv_bytes(size);
  std::vector<uint8_t> send;
  for (int dst = 0; dst < size; ++dst) {
    send_bytes[dst] = PairBytes(rank, dst, size);
    recv_bytes[dst] = PairBytes(dst, rank, size);
    for (size_t i = 0; i < send_bytes[dst]; ++i) send.push_back(PairByte(rank, dst, i));
  }
  size_t recv_total = 0;
  for (size_t b : recv_bytes) recv_total += b;
  std::vector<uint8_t> recv(recv_total, 0xee);
  if (absl::Status s = comm.AllToAllV(send.data(), send_bytes, recv.data(), recv_bytes); !s.ok()) {
    return s;
  }
  size_t offset = 0;
  for (int src = 0; src < size; ++src) {
    for (size_t i = 0; i < recv_bytes[src]; ++i) {
      if (recv[offset + i] != PairByte(src, rank, i)) {
        return absl::InternalError(absl::StrCat("all-to-all byte ", i, " from ", src));
      }
    }
    offset += recv_bytes[src];
  }
  // Everything zero: nothing to send or receive anywhere.
  std::vector<size_t> zeros(size, 0);
  if (absl::Status s = comm.AllToAllV(nullptr, zeros, nullptr, zeros); !s.ok()) return s;
  return comm.Barrier();
}

// Runs fn(rank) on `size` threads that share one in-memory store.
void RunThreads(int size, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

class GlooThreadsTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooThreadsTest, AllCollectives) {
  const int size = GetParam();
  auto store = std::make_shared<MemoryKeyValueStore>();
  std::vector<absl::Status> status(size);
  std::vector<std::vector<float>> sums(size);
  RunThreads(size, [&](int rank) {
    auto comm =
        MakeGlooCommunicator(store, "threads", rank, size, Timeout(absl::Seconds(20)), kLoopback);
    if (!comm.ok()) {
      status[rank] = comm.status();
      return;
    }
    EXPECT_EQ((*comm)->rank(), rank);
    EXPECT_EQ((*comm)->size(), size);
    EXPECT_EQ((*comm)->name(), "gloo");
    EXPECT_EQ((*comm)->memory_space(), MemorySpace::kHost);
    status[rank] = ExerciseCollectives(**comm, &sums[rank]);
  });
  for (int r = 0; r < size; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  // The same bits on every rank, and the right sum.
  for (int r = 1; r < size; ++r) {
    ASSERT_EQ(std::memcmp(sums[0].data(), sums[r].data(), sums[0].size() * sizeof(float)), 0)
        << "rank " << r << " got different float bits";
  }
  for (size_t i = 0; i < sums[0].size(); ++i) {
    double expected = 0;
    for (int r = 0; r < size; ++r) expected += FloatInput(r, sums[0].size())[i];
    EXPECT_NEAR(sums[0][i], expected, 1e-6 * std::abs(expected)) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, GlooThreadsTest, ::testing::Values(1, 2, 3, 4));

TEST(GlooCommunicatorTest, BadArguments) {
  auto store = std::make_shared<MemoryKeyValueStore>();
  const CommOptions options = Timeout(absl::Seconds(5));
  EXPECT_EQ(MakeGlooCommunicator(nullptr, "p", 0, 1, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeGlooCommunicator(store, "p", 2, 2, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeGlooCommunicator(store, "p", 0, 0, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeGlooCommunicator(store, "p", 0, 1, Timeout(absl::ZeroDuration())).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto comm = MakeGlooCommunicator(store, "single", 0, 1, options, kLoopback);
  ASSERT_TRUE(comm.ok()) << comm.status();
  uint16_t bf16[2] = {0, 0};
  EXPECT_EQ((*comm)->AllReduceSum(bf16, 2, DType::kBFloat16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*comm)->AllReduceSum(nullptr, 2, DType::kFloat32).code(),
            absl::StatusCode::kInvalidArgument);
  uint8_t byte = 7, got = 0;
  EXPECT_EQ((*comm)->AllGather(nullptr, &got, 1).code(), absl::StatusCode::kInvalidArgument);
  // These are caught before any communication (every rank passes the same dtype and count,
  // so every rank finds them): the communicator still works.
  std::vector<size_t> one = {1};
  ASSERT_TRUE((*comm)->AllToAllV(&byte, one, &got, one).ok());
  EXPECT_EQ(got, 7);

  // AllToAllV's sizes differ by rank, so only some ranks may find them wrong: a bad call
  // breaks the communicator (the peers fail at once; see AllToAllSizeMismatchIsAnErrorOnBothRanks).
  std::vector<size_t> two = {1, 1};
  std::vector<size_t> other = {2};
  for (const auto& [send, recv] : {std::pair(two, one), std::pair(one, other)}) {
    auto fresh = MakeGlooCommunicator(store, absl::StrCat("single", send.size(), recv[0]), 0, 1,
                                      options, kLoopback);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    absl::Status bad = (*fresh)->AllToAllV(&byte, send, &got, recv);
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
    absl::Status after = (*fresh)->Barrier();
    EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
    EXPECT_NE(after.message().find("broken"), absl::string_view::npos) << after;
  }
}

// A very long (or infinite) timeout means "wait", not "fail at once": Gloo adds the timeout to
// the clock in nanoseconds, where absl::InfiniteDuration (INT64_MAX ms) overflowed.
TEST(GlooCommunicatorTest, HugeTimeoutsStillWait) {
  for (const absl::Duration timeout : {absl::InfiniteDuration(), absl::Hours(24 * 365 * 1000)}) {
    auto store = std::make_shared<MemoryKeyValueStore>();
    std::vector<absl::Status> status(2);
    std::vector<float> sums(2);
    RunThreads(2, [&](int rank) {
      auto comm = MakeGlooCommunicator(store, "long", rank, 2, Timeout(timeout), kLoopback);
      if (!comm.ok()) {
        status[rank] = comm.status();
        return;
      }
      if (rank == 1) absl::SleepFor(absl::Milliseconds(200));  // rank 0 must wait for it
      float v = 1.0f + rank;
      status[rank] = (*comm)->AllReduceSum(&v, 1, DType::kFloat32);
      sums[rank] = v;
      if (status[rank].ok()) status[rank] = (*comm)->Barrier();
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(status[r].ok()) << absl::FormatDuration(timeout) << " rank " << r << ": "
                                  << status[r];
      EXPECT_EQ(sums[r], 3.0f);
    }
  }
}

TEST(GlooCommunicatorTest, RankThatNeverArrivesTimesOutConnect) {
  auto store = std::make_shared<MemoryKeyValueStore>();
  const absl::Time start = absl::Now();
  auto comm =
      MakeGlooCommunicator(store, "alone", 0, 2, Timeout(absl::Milliseconds(500)), kLoopback);
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_LT(waited, absl::Seconds(3));
}

TEST(GlooCommunicatorTest, PeerThatStopsCallingTimesOutAndBreaksTheCommunicator) {
  auto store = std::make_shared<MemoryKeyValueStore>();
  absl::Status first, second;
  absl::Duration waited;
  RunThreads(2, [&](int rank) {
    auto comm =
        MakeGlooCommunicator(store, "hang", rank, 2, Timeout(absl::Milliseconds(700)), kLoopback);
    ASSERT_TRUE(comm.ok()) << comm.status();
    if (rank == 1) {
      absl::SleepFor(absl::Seconds(2));  // never joins the all-reduce; then leaves
      return;
    }
    std::vector<float> v(16, 1.0f);
    const absl::Time start = absl::Now();
    first = (*comm)->AllReduceSum(v.data(), v.size(), DType::kFloat32);
    waited = absl::Now() - start;
    second = (*comm)->Barrier();
  });
  EXPECT_EQ(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  EXPECT_LT(waited, absl::Seconds(2));
  EXPECT_EQ(second.code(), absl::StatusCode::kUnavailable) << second;
  EXPECT_TRUE(absl::StrContains(second.message(), "broken")) << second;
}

// ---- separate processes, file store ----

absl::StatusOr<std::unique_ptr<Communicator>> WorkerComm(const WorkerContext& ctx,
                                                         absl::Duration timeout) {
  auto store = FileKeyValueStore::Create(ctx.store_dir);
  if (!store.ok()) return store.status();
  return MakeGlooCommunicator(*store, "procs", ctx.rank, ctx.size, Timeout(timeout), kLoopback);
}

MOED_WORKER(collectives, const WorkerContext& ctx) {
  auto comm = WorkerComm(ctx, absl::Seconds(20));
  if (!comm.ok()) return comm.status();
  std::vector<float> sum;
  if (absl::Status s = ExerciseCollectives(**comm, &sum); !s.ok()) return s;
  return WriteResult(ctx, "float_sum", EncodeValues(sum));
}

// Rank `victim` exits without a word in the middle of a run of all-to-alls; the others must
// come back with an error within their timeout, and fail fast afterwards.
MOED_WORKER(peer_dies, const WorkerContext& ctx) {
  auto comm = WorkerComm(ctx, absl::Seconds(5));
  if (!comm.ok()) return comm.status();
  const int victim = static_cast<int>(ctx.IntParam("victim", 1));
  std::vector<size_t> bytes(ctx.size, 4096);
  std::vector<uint8_t> send(4096 * ctx.size, 1), recv(4096 * ctx.size);
  for (int step = 0; step < 10; ++step) {
    if (ctx.rank == victim && step == 3) std::_Exit(3);
    const absl::Time start = absl::Now();
    absl::Status s = (*comm)->AllToAllV(send.data(), bytes, recv.data(), bytes);
    if (!s.ok()) {
      const absl::Duration waited = absl::Now() - start;
      absl::Status again = (*comm)->Barrier();
      const std::string report = absl::StrCat(step, " ", absl::StatusCodeToString(s.code()), " ",
                                              absl::ToInt64Milliseconds(waited), " ",
                                              absl::StatusCodeToString(again.code()));
      std::fprintf(stderr, "step %d: %s; then %s\n", step, s.ToString().c_str(),
                   again.ToString().c_str());
      return WriteResult(ctx, "failure", report);
    }
  }
  return absl::InternalError("all steps succeeded although a peer died");
}

// Rank 1 expects `expect` bytes from rank 0, which sends 8 (or, with self=1, rank 1 sends
// itself 8 bytes and expects `expect`): a caller bug that must come back as an error on both
// ranks, never as a crash, a silently short buffer or a peer waiting for its timeout.
MOED_WORKER(size_mismatch, const WorkerContext& ctx) {
  auto comm = WorkerComm(ctx, absl::Seconds(5));
  if (!comm.ok()) return comm.status();
  std::vector<size_t> send = {0, 0}, recv = {0, 0};
  const size_t expect = static_cast<size_t>(ctx.IntParam("expect", 8));
  if (ctx.IntParam("self", 0) == 1) {
    if (ctx.rank == 1) send[1] = 8, recv[1] = expect;
  } else {
    if (ctx.rank == 0) send[1] = 8;
    if (ctx.rank == 1) recv[0] = expect;
  }
  std::vector<uint8_t> in(16, 1), out(16, 0);
  const absl::Time start = absl::Now();
  absl::Status s = (*comm)->AllToAllV(in.data(), send, out.data(), recv);
  const absl::Duration waited = absl::Now() - start;
  std::fprintf(stderr, "rank %d: %s\n", ctx.rank, s.ToString().c_str());
  return WriteResult(
      ctx, "code",
      absl::StrCat(absl::StatusCodeToString(s.code()), " ", absl::ToInt64Milliseconds(waited)));
}

TEST(GlooProcessesTest, AllToAllSizeMismatchIsAnErrorOnBothRanks) {
  for (const auto& [expect, self] : {std::pair(4, 0), std::pair(12, 0), std::pair(4, 1)}) {
    LaunchOptions launch;
    launch.worker = "size_mismatch";
    launch.size = 2;
    launch.params = {{"expect", std::to_string(expect)}, {"self", std::to_string(self)}};
    launch.deadline = absl::Seconds(20);
    auto run = RunWorkers(launch);
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_TRUE(run->AllSucceeded()) << "expect " << expect << " self " << self << "\n"
                                     << run->Summary();
    auto receiver = ReadResult(run->ranks[1], "code");
    auto sender = ReadResult(run->ranks[0], "code");
    ASSERT_TRUE(receiver.ok() && sender.ok());
    EXPECT_TRUE(absl::StartsWith(*receiver, "INVALID_ARGUMENT ")) << *receiver;
    EXPECT_TRUE(absl::StartsWith(*sender, "UNAVAILABLE ")) << *sender;
    // Rank 0 learns at once (closed connection), not at its 5 s timeout.
    int waited_ms = 0;
    ASSERT_EQ(std::sscanf(sender->c_str(), "%*s %d", &waited_ms), 1);
    EXPECT_LT(waited_ms, 4000) << *sender;
  }
}

class GlooProcessesTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooProcessesTest, AllCollectives) {
  LaunchOptions launch;
  launch.worker = "collectives";
  launch.size = GetParam();
  launch.deadline = absl::Seconds(40);
  auto run = RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(run->AllSucceeded()) << run->Summary();
  auto first = ReadResult(run->ranks[0], "float_sum");
  ASSERT_TRUE(first.ok());
  for (int r = 1; r < launch.size; ++r) {
    auto other = ReadResult(run->ranks[r], "float_sum");
    ASSERT_TRUE(other.ok());
    EXPECT_EQ(*first, *other) << "rank " << r << " all-reduce bits differ from rank 0";
  }
}

TEST_P(GlooProcessesTest, PeerExitMidCollectiveFailsTheOthersWithinTheTimeout) {
  LaunchOptions launch;
  launch.worker = "peer_dies";
  launch.size = GetParam();
  launch.params = {{"victim", std::to_string(launch.size - 1)}};
  launch.deadline = absl::Seconds(30);
  auto run = RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  const int victim = launch.size - 1;
  EXPECT_EQ(run->ranks[victim].exit_code, 3) << run->Summary();
  for (int r = 0; r < victim; ++r) {
    const harness::RankResult& rank = run->ranks[r];
    ASSERT_TRUE(rank.ok()) << run->Summary();
    auto report = ReadResult(rank, "failure");
    ASSERT_TRUE(report.ok()) << run->Summary();
    int step = -1, waited_ms = -1;
    char code[64], then[64];
    ASSERT_EQ(std::sscanf(report->c_str(), "%d %63s %d %63s", &step, code, &waited_ms, then), 4)
        << *report;
    // The step the victim skipped (or the one before, whose sends it may not have drained).
    EXPECT_GE(step, 2) << *report;
    EXPECT_LE(step, 3) << *report;
    EXPECT_TRUE(std::string(code) == "UNAVAILABLE" || std::string(code) == "DEADLINE_EXCEEDED")
        << *report;
    EXPECT_LE(waited_ms, 5000 + 1000) << *report;
    EXPECT_EQ(std::string(then), "UNAVAILABLE") << *report;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, GlooProcessesTest, ::testing::Values(2, 4));

}  // namespace
}  // namespace moe
