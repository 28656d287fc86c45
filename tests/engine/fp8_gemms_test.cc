// The per-GEMM FP8 choice (LayerConfig::fp8_gemms, docs/SPEC.md "Per-GEMM choice") on the CPU
// backend: layers with a mixed set against the fp64 reference within SPEC's FP8 tolerances
// (each GEMM kind once in FP8 and once in bf16 over the two sets), the empty set bit for bit
// the BF16 layer, the resolved set as the layer reports it (AUTO's CPU rule, ALL, explicit),
// and the amax histories of tensors no FP8 GEMM reads left untouched.
#include <cstring>
#include <random>
#include <vector>

#include "engine/fp8_gemms.h"
#include "engine/fp8_history.h"
#include "gtest/gtest.h"
#include "tests/engine/fp8_rounding.h"
#include "tests/engine/tiny_config.h"
#include "tests/reference/engine_adapter.h"
#include "tests/reference/finite_difference.h"
#include "tests/reference/reference_moe.h"

namespace moe_ref {
namespace {

using moe::DType;
using moe::Fp8Gemm;
using moe::Fp8GemmSet;
using moe::Fp8GemmsPolicy;
using moe::LayerConfig;
using moe::Tensor;

// docs/SPEC.md "FP8" (as tests/engine/fp8_layer_test.cc).
constexpr double kFp8Out = 8e-2;
constexpr double kFp8Grad = 1e-1;

Fp8GemmSet Set(std::initializer_list<Fp8Gemm> gemms) {
  Fp8GemmSet s = 0;
  for (Fp8Gemm g : gemms) s |= moe::Fp8GemmBit(g);
  return s;
}
const Fp8GemmSet kFc1 = Set({Fp8Gemm::kFc1Fprop, Fp8Gemm::kFc1Dgrad, Fp8Gemm::kFc1Wgrad});

// H 32, F 8 (gated, up 16): under AUTO the CPU rule (engine/fp8_gemms.h CpuFp8GemmPays) runs
// fc1 (H 32, up 16) in FP8 and fc2 (F 8) in bf16.
LayerConfig NarrowConfig(DType compute) {
  LayerConfig c = moe::TinyLayerConfig();
  c.ffn = 8;
  c.aux_loss_coeff = 1e-2;
  c.z_loss_coeff = 1e-3;
  c.init_seed = 40;
  c.compute_dtype = compute;
  return c;
}

Fp8GemmsPolicy Explicit(Fp8GemmSet set) {
  Fp8GemmsPolicy p;
  p.kind = Fp8GemmsPolicy::Kind::kSet;
  p.set = set;
  return p;
}

Fp8GemmSet Resolved(LayerConfig c) {
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(c);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  return cpu.ok() ? cpu->layer->fp8_gemms() : ~0u;
}

TEST(Fp8GemmsTest, TheLayerReportsTheResolvedSet) {
  LayerConfig c = NarrowConfig(DType::kFloat8E4M3);
  EXPECT_EQ(Resolved(c), kFc1);  // AUTO
  EXPECT_EQ(moe::Fp8GemmSetName(kFc1), "fc1_fprop,fc1_dgrad,fc1_wgrad");
  c.fp8_gemms.kind = Fp8GemmsPolicy::Kind::kAll;
  EXPECT_EQ(Resolved(c), moe::kAllFp8Gemms);
  c.fp8_gemms = Explicit(Set({Fp8Gemm::kFc2Wgrad}));
  EXPECT_EQ(Resolved(c), Set({Fp8Gemm::kFc2Wgrad}));
  LayerConfig wide = moe::TinyLayerConfig();  // F 64: every GEMM wins under the CPU rule
  wide.compute_dtype = DType::kFloat8E4M3;
  EXPECT_EQ(Resolved(wide), moe::kAllFp8Gemms);
  EXPECT_EQ(Resolved(NarrowConfig(DType::kBFloat16)), 0u);
}

// Random fp32 tokens whose top-k selection is not decided by a gap below 1e-4.
std::vector<double> Tokens(const RefConfig& rc, const RefParams& p, int64_t tokens,
                           std::mt19937_64* rng) {
  const int64_t H = rc.hidden;
  std::vector<double> x(tokens * H);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int attempt = 0; attempt < 100; ++attempt) {
      std::vector<double> row =
          ToDoubles(FromDoubles(RandomNormal(H, 1.0, rng), {H}, DType::kFloat32));
      std::copy(row.begin(), row.end(), x.begin() + t * H);
      if (RefForward(rc, p, row, 1).routing.min_selection_gap > 1e-4) break;
    }
  }
  return x;
}

std::vector<double> RoundToBf16(const std::vector<double>& w) {
  return ToDoubles(FromDoubles(w, {static_cast<int64_t>(w.size())}, DType::kBFloat16));
}

// Each set keeps both data GEMMs of a weight in one precision (the reference is fed that
// weight rounded as those GEMMs read it: e4m3 per expert, or bf16); the weight gradients
// are free. Over the two sets every GEMM kind runs once in FP8 and once in bf16.
class MixedSetTest : public ::testing::TestWithParam<Fp8GemmsPolicy> {};

TEST_P(MixedSetTest, MatchesTheReferenceWithinTheFp8Tolerance) {
  LayerConfig c = NarrowConfig(DType::kFloat8E4M3);
  c.fp8_gemms = GetParam();
  SCOPED_TRACE(moe::ConfigToString(c));
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(c);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const Fp8GemmSet set = cpu->layer->fp8_gemms();
  ASSERT_NE(set, 0u);
  ASSERT_NE(set, moe::kAllFp8Gemms);
  const RefConfig rc = FromLayerConfig(c);
  RefParams params = ReadParams(*cpu->layer).value();
  std::mt19937_64 rng(4001);
  const int64_t tokens = 64;
  const std::vector<double> xd = Tokens(rc, params, tokens, &rng);
  const Tensor x = FromDoubles(xd, {tokens, c.hidden}, DType::kFloat32);
  const Tensor d_out =
      FromDoubles(RandomNormal(tokens * c.hidden, 1.0, &rng), {tokens, c.hidden}, DType::kFloat32);
  absl::StatusOr<EngineStep> step = RunStep(cpu->layer.get(), x, &d_out, 0.7, 1.3);
  ASSERT_TRUE(step.ok()) << step.status();
  params.wi = moe::Fp8GemmIn(set, Fp8Gemm::kFc1Fprop) ? RoundExpertsToE4M3(params.wi, c.num_experts)
                                                      : RoundToBf16(params.wi);
  params.wo = moe::Fp8GemmIn(set, Fp8Gemm::kFc2Fprop) ? RoundExpertsToE4M3(params.wo, c.num_experts)
                                                      : RoundToBf16(params.wo);
  const RefForwardResult ref = RefForward(rc, params, xd, tokens);
  const RefGradients grad = RefBackward(rc, params, xd, ref, ToDoubles(d_out), 0.7, 1.3);
  const RefGradients eg = ReadGradients(*cpu->layer).value();
  EXPECT_EQ(step->forward.tokens_per_expert, ref.tokens_per_expert);
  const double out = RelativeError(ToDoubles(step->forward.out), ref.out);
  const double d_x = RelativeError(ToDoubles(step->d_x), grad.d_x);
  const double d_wi = RelativeError(eg.d_wi, grad.d_wi);
  const double d_wo = RelativeError(eg.d_wo, grad.d_wo);
  EXPECT_LE(out, kFp8Out);
  EXPECT_LE(d_x, kFp8Grad);
  EXPECT_LE(RelativeError(eg.d_gate, grad.d_gate), kFp8Grad);
  EXPECT_LE(d_wi, kFp8Grad);
  EXPECT_LE(d_wo, kFp8Grad);
  std::printf("fp8_gemms=%s: out %.2e d_x %.2e d_wi %.2e d_wo %.2e\n",
              moe::Fp8GemmSetName(set).c_str(), out, d_x, d_wi, d_wo);
}

INSTANTIATE_TEST_SUITE_P(
    Sets, MixedSetTest,
    ::testing::Values(Fp8GemmsPolicy{},  // AUTO: fc1 FP8, fc2 bf16
                      Explicit(Set({Fp8Gemm::kFc2Fprop, Fp8Gemm::kFc2Dgrad, Fp8Gemm::kFc1Wgrad}))),
    [](const ::testing::TestParamInfo<Fp8GemmsPolicy>& info) {
      return info.param.kind == Fp8GemmsPolicy::Kind::kAuto ? std::string("Auto")
                                                            : std::string("Fc2DataFc1Wgrad");
    });

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.num_bytes() == b.num_bytes() &&
         std::memcmp(a.raw(), b.raw(), a.num_bytes()) == 0;
}

// fp8_gemms = none: every GEMM as the BF16 layer runs it, so the whole step is that layer's,
// bit for bit, over steps with an optimizer step between (the bf16 weight copy follows).
TEST(Fp8GemmsTest, NoFp8GemmIsTheBf16LayerBitForBit) {
  LayerConfig fp8 = NarrowConfig(DType::kFloat8E4M3);
  fp8.fp8_gemms = Explicit(0);
  absl::StatusOr<CpuLayer> a = MakeCpuLayer(fp8);
  absl::StatusOr<CpuLayer> b = MakeCpuLayer(NarrowConfig(DType::kBFloat16));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->layer->fp8_gemms(), 0u);
  std::mt19937_64 rng(4002);
  for (int s = 0; s < 3; ++s) {
    SCOPED_TRACE(s);
    const Tensor x =
        FromDoubles(RandomNormal(48 * fp8.hidden, 1.0, &rng), {48, fp8.hidden}, DType::kBFloat16);
    const Tensor d_out =
        FromDoubles(RandomNormal(48 * fp8.hidden, 1.0, &rng), {48, fp8.hidden}, DType::kBFloat16);
    absl::StatusOr<EngineStep> sa = RunStep(a->layer.get(), x, &d_out, 0.7, 1.3);
    absl::StatusOr<EngineStep> sb = RunStep(b->layer.get(), x, &d_out, 0.7, 1.3);
    ASSERT_TRUE(sa.ok()) << sa.status();
    ASSERT_TRUE(sb.ok()) << sb.status();
    EXPECT_TRUE(SameBytes(sa->forward.out, sb->forward.out));
    EXPECT_TRUE(SameBytes(sa->d_x, sb->d_x));
    EXPECT_EQ(sa->forward.aux_loss, sb->forward.aux_loss);
    for (const std::string& name : a->layer->ParameterNames()) {
      absl::StatusOr<Tensor> ga = a->layer->GetGradient(name);
      absl::StatusOr<Tensor> gb = b->layer->GetGradient(name);
      ASSERT_TRUE(ga.ok() && gb.ok()) << name;
      EXPECT_TRUE(SameBytes(*ga, *gb)) << name;
    }
    const moe::OptimizerConfig sgd = moe::OptimizerConfig::Sgd(0.05);
    ASSERT_TRUE(a->layer->ApplyOptimizer(sgd).ok());
    ASSERT_TRUE(b->layer->ApplyOptimizer(sgd).ok());
  }
}

// The durable state keeps its names and shapes whatever the set; a tensor that no FP8 GEMM
// reads is never quantised, so its history records no step (AUTO here: X and d_h feed fc1's
// FP8 GEMMs, a and d_y only fc2's bf16 ones).
TEST(Fp8GemmsTest, HistoriesRecordOnlyQuantisedTensors) {
  LayerConfig all = NarrowConfig(DType::kFloat8E4M3);
  all.fp8_gemms.kind = Fp8GemmsPolicy::Kind::kAll;
  absl::StatusOr<CpuLayer> a = MakeCpuLayer(NarrowConfig(DType::kFloat8E4M3));
  absl::StatusOr<CpuLayer> b = MakeCpuLayer(all);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->layer->StateNames(), b->layer->StateNames());
  std::mt19937_64 rng(4003);
  const LayerConfig& c = a->layer->config();
  const Tensor x =
      FromDoubles(RandomNormal(40 * c.hidden, 1.0, &rng), {40, c.hidden}, DType::kFloat32);
  const Tensor d_out =
      FromDoubles(RandomNormal(40 * c.hidden, 1.0, &rng), {40, c.hidden}, DType::kFloat32);
  ASSERT_TRUE(RunStep(a->layer.get(), x, &d_out, 0.7, 1.3).ok());
  ASSERT_TRUE(RunStep(b->layer.get(), x, &d_out, 0.7, 1.3).ok());
  absl::StatusOr<Tensor> steps_a = a->layer->GetState(moe::Fp8History::kStepsName);
  absl::StatusOr<Tensor> steps_b = b->layer->GetState(moe::Fp8History::kStepsName);
  ASSERT_TRUE(steps_a.ok() && steps_b.ok());
  EXPECT_EQ(ToDoubles(*steps_a), (std::vector<double>{1, 0, 0, 1}));  // X, a, d_y, d_h
  EXPECT_EQ(ToDoubles(*steps_b), (std::vector<double>{1, 1, 1, 1}));
  absl::StatusOr<Tensor> history = a->layer->GetState(moe::Fp8History::kHistoryName);
  ASSERT_TRUE(history.ok());
  EXPECT_EQ(history->shape(), (std::vector<int64_t>{4, c.fp8_amax_history_len}));
}

}  // namespace
}  // namespace moe_ref
