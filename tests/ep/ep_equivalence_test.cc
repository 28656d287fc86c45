// EP=R equals EP=1: the same global batch, seed and loss gradients, split into uneven
// contiguous token slices (one rank with none in some cases) over R Gloo worker processes,
// give the outputs, aux and z-loss, tokens_per_expert and every gradient of EP=1 (fp32,
// max-norm relative error <= 1e-5), for softmax and grouped sigmoid, align_size 0 and 16,
// capacity on and off, biases on, and all tokens routed to one rank's experts. The gate
// gradient must be bit-identical on every rank. Cases and the reference: ep_cases.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/comm/file_kv_store.h"
#include "engine/comm/gloo_communicator.h"
#include "gtest/gtest.h"
#include "tests/ep/ep_cases.h"
#include "tests/harness/multiprocess.h"

namespace moe {
namespace ep_test {
namespace {

using harness::DecodeValues;
using harness::EncodeValues;
using harness::RankResult;
using harness::ReadResult;
using harness::WorkerContext;
using harness::WriteResult;

absl::Status WriteStep(const WorkerContext& ctx, const std::string& name, const StepResult& s) {
  const std::pair<std::string, std::string> files[] = {
      {".out", EncodeValues(s.out)},
      {".d_x", EncodeValues(s.d_x)},
      {".out2", EncodeValues(s.out_after_step)},
      {".losses", EncodeValues(std::vector<double>{s.aux_loss, s.z_loss})},
      {".tokens_per_expert", EncodeValues(s.tokens_per_expert)},
      {".expert_bias_after", EncodeValues(s.expert_bias_after)},
  };
  for (const auto& [suffix, bytes] : files) {
    if (absl::Status st = WriteResult(ctx, name + suffix, bytes); !st.ok()) return st;
  }
  for (const auto& [param, grad] : s.grads) {
    if (absl::Status st = WriteResult(ctx, name + ".grad." + param, EncodeValues(grad)); !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

// Every case at EP = ctx.size over one Gloo communicator.
MOED_WORKER(ep_step, const WorkerContext& ctx) {
  auto store = FileKeyValueStore::Create(ctx.store_dir);
  if (!store.ok()) return store.status();
  CommOptions options;
  options.timeout = absl::Seconds(30);
  auto comm = MakeGlooCommunicator(*store, "ep", ctx.rank, ctx.size, options,
                                   GlooTransportOptions{"", "127.0.0.1"});
  if (!comm.ok()) return comm.status();
  for (const EpCase& c : EpCases(ctx.size)) {
    const std::vector<int64_t> offsets = SliceOffsets(c, ctx.size);
    auto step = RunStep(c, comm->get(), offsets[ctx.rank], offsets[ctx.rank + 1], c.d_aux, c.d_zl,
                        /*zero_d_out=*/false);
    if (!step.ok()) {
      return absl::Status(step.status().code(),
                          absl::StrCat("case ", c.name, ": ", step.status().message()));
    }
    if (absl::Status s = WriteStep(ctx, c.name, *step); !s.ok()) return s;
  }
  return absl::OkStatus();
}

template <typename T>
std::vector<T> Read(const RankResult& rank, const std::string& file) {
  auto bytes = ReadResult(rank, file);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  if (!bytes.ok()) return {};
  auto values = DecodeValues<T>(*bytes);
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *values : std::vector<T>{};
}

std::vector<float> ExpertRows(const std::vector<float>& whole, int64_t experts, int64_t first,
                              int64_t count) {
  const int64_t row = static_cast<int64_t>(whole.size()) / experts;
  return std::vector<float>(whole.begin() + first * row, whole.begin() + (first + count) * row);
}

double RelativeScalarError(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-30);
}

class EpEquivalenceTest : public ::testing::TestWithParam<int> {};

TEST_P(EpEquivalenceTest, MatchesEp1) {
  const int ranks = GetParam();
  harness::LaunchOptions launch;
  launch.worker = "ep_step";
  launch.size = ranks;
  launch.deadline = absl::Seconds(50);
  auto run = harness::RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(run->AllSucceeded()) << run->Summary();

  for (const EpCase& c : EpCases(ranks)) {
    SCOPED_TRACE(absl::StrCat("case ", c.name, " at EP=", ranks));
    auto refs = EpReference(c, ranks);
    ASSERT_TRUE(refs.ok()) << refs.status();
    const int64_t E = c.config.num_experts, El = E / ranks;
    const double kTolerance = c.tolerance;
    std::vector<float> gate_rank0;
    for (int r = 0; r < ranks; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r));
      const RankResult& rank = run->ranks[r];
      const StepResult& ref = (*refs)[r];
      EXPECT_LE(MaxRelativeError(Read<float>(rank, c.name + ".out"), ref.out), kTolerance);
      EXPECT_LE(MaxRelativeError(Read<float>(rank, c.name + ".d_x"), ref.d_x), kTolerance);
      EXPECT_LE(MaxRelativeError(Read<float>(rank, c.name + ".out2"), ref.out_after_step),
                kTolerance);
      const std::vector<double> losses = Read<double>(rank, c.name + ".losses");
      ASSERT_EQ(losses.size(), 2u);
      EXPECT_LE(RelativeScalarError(losses[0], ref.aux_loss), kTolerance)
          << losses[0] << " vs " << ref.aux_loss;
      EXPECT_LE(RelativeScalarError(losses[1], ref.z_loss), kTolerance)
          << losses[1] << " vs " << ref.z_loss;
      EXPECT_EQ(Read<int64_t>(rank, c.name + ".tokens_per_expert"), ref.tokens_per_expert);
      // Sign updates from integer counts: exactly the same.
      EXPECT_EQ(Read<float>(rank, c.name + ".expert_bias_after"), ref.expert_bias_after);
      for (const std::string& name : GradientNames(c.config)) {
        SCOPED_TRACE("gradient " + name);
        const std::vector<float> grad = Read<float>(rank, c.name + ".grad." + name);
        const std::vector<float>& whole = ref.grads.at(name);
        if (IsExpertTensor(name)) {
          EXPECT_LE(MaxRelativeError(grad, ExpertRows(whole, E, r * El, El)), kTolerance);
        } else {
          EXPECT_LE(MaxRelativeError(grad, whole), kTolerance);
          if (r == 0) gate_rank0 = grad;
          ASSERT_EQ(grad.size(), gate_rank0.size());
          EXPECT_EQ(std::memcmp(grad.data(), gate_rank0.data(), grad.size() * sizeof(float)), 0)
              << "the gate gradient differs from rank 0's";
        }
      }
    }
  }
}

// The capacity cases would test nothing beyond the dropless ones if no pair were dropped per
// rank: their EP=R outputs must differ from a whole-batch EP=1 run (one capacity for all T_g).
TEST(EpCasesTest, CapacityIsPerRankAndDrops) {
  for (const int ranks : {2, 4, 8}) {
    for (const EpCase& c : EpCases(ranks)) {
      if (c.config.capacity_factor == 0.0 || c.global_tokens == 0) continue;
      SCOPED_TRACE(absl::StrCat("case ", c.name, " at EP=", ranks));
      auto refs = EpReference(c, ranks);
      ASSERT_TRUE(refs.ok()) << refs.status();
      EpCase dropless = c;
      dropless.config.capacity_factor = 0.0;
      dropless.second_step = false;
      auto whole = EpReference(dropless, ranks);
      ASSERT_TRUE(whole.ok()) << whole.status();
      double largest = 0.0;
      for (int r = 0; r < ranks; ++r) {
        largest = std::max(largest, MaxRelativeError((*refs)[r].out, (*whole)[r].out));
      }
      EXPECT_GT(largest, 1e-2) << "no rank dropped anything";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpEquivalenceTest, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return absl::StrCat("ep", info.param); });

}  // namespace
}  // namespace ep_test
}  // namespace moe
