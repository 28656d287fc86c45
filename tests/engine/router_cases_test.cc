// The router cases of docs/SPEC.md "Reference test shapes": (T, E, k) in {(128,32,4), (2048,32,4),
// (2048,128,8), (7168,128,4), (7168,32,8)} x group_topk {none, 4 of 8 groups} x scaling
// {1, 1.2} x {softmax post, softmax pre, sigmoid, sigmoid + expert bias}. The selected set
// must match the reference exactly: tokens_per_expert is compared exactly, and with a tiny H
// every token's output (a wrong expert changes a token's output completely).
//
// To make "exactly" meaningful at these sizes, the logits are exact in fp32 and fp64 alike:
// gate and x hold multiples of 2^-6 (|x| <= 4, |gate| <= 2, H = 16), so every product and sum
// is exact whatever the summation order. Rows whose routing hinges on a gap below 1e-5 (where
// fp32 sigmoid/softmax rounding could decide) are redrawn; all-zero rows are kept on purpose:
// their logits tie exactly, testing the tie rule (lower expert index; lower group index), and
// the FFN biases give them an output that depends on which experts were chosen.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "tests/reference/engine_adapter.h"
#include "tests/reference/finite_difference.h"
#include "tests/reference/reference_moe.h"

namespace moe_ref {
namespace {

using moe::DType;
using moe::LayerConfig;
using moe::Tensor;

struct Shape {
  int64_t tokens, experts, top_k;
};
enum class Scoring { kSoftmaxPost, kSoftmaxPre, kSigmoid, kSigmoidBias };
using Case = std::tuple<Shape, bool /*grouped*/, double /*scaling*/, Scoring>;

constexpr int64_t kHidden = 16;
constexpr int64_t kFfn = 4;
constexpr int kZeroRowEvery = 17;

double Quantize(double v, double bound) {
  return std::clamp(std::round(v * 64.0) / 64.0, -bound, bound);
}

LayerConfig ConfigFor(const Case& c) {
  const auto& [shape, grouped, scaling, scoring] = c;
  LayerConfig config;
  config.hidden = kHidden;
  config.ffn = kFfn;
  config.num_experts = shape.experts;
  config.top_k = shape.top_k;
  config.scaling_factor = scaling;
  if (grouped) {
    config.num_groups = 8;
    config.group_topk = 4;
  }
  config.score_function = (scoring == Scoring::kSigmoid || scoring == Scoring::kSigmoidBias)
                              ? moe::ScoreFunction::kSigmoid
                              : moe::ScoreFunction::kSoftmax;
  config.pre_softmax = scoring == Scoring::kSoftmaxPre;
  config.use_expert_bias = scoring == Scoring::kSigmoidBias;
  config.use_bias = true;  // so all-zero rows still get an expert-dependent output
  config.init_seed = 99;
  return config;
}

class RouterCasesTest : public ::testing::TestWithParam<Case> {};

TEST_P(RouterCasesTest, SelectedSetMatchesReferenceExactly) {
  const LayerConfig config = ConfigFor(GetParam());
  const int64_t T = std::get<0>(GetParam()).tokens, E = config.num_experts;
  SCOPED_TRACE(moe::ConfigToString(config) + " T=" + std::to_string(T));
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(config);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const RefConfig rc = FromLayerConfig(config);

  std::mt19937_64 rng(T * 1000 + E);
  std::normal_distribution<double> normal(0.0, 1.0);
  RefParams params = ReadParams(*cpu->layer).value();
  for (double& g : params.gate) g = Quantize(0.5 * normal(rng), 2.0);
  for (double& b : params.wi_bias) b = static_cast<float>(0.5 * normal(rng));
  for (double& b : params.wo_bias) b = static_cast<float>(0.5 * normal(rng));
  if (config.use_expert_bias) {
    // Multiples of 2^-8: exact ties between experts happen, other gaps are >= 2^-8.
    std::uniform_int_distribution<int> step(-16, 16);
    for (double& b : params.expert_bias) b = step(rng) / 256.0;
  }
  ASSERT_TRUE(WriteParams(params, cpu->layer.get()).ok());

  std::vector<double> x(T * kHidden, 0.0);
  int64_t redrawn = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (t % kZeroRowEvery == 0) continue;
    for (int attempt = 0;; ++attempt) {
      ASSERT_LT(attempt, 100) << "no well-separated row found for token " << t;
      std::vector<double> row(kHidden);
      for (double& v : row) v = Quantize(normal(rng), 4.0);
      RefForwardResult one = RefForward(rc, params, row, 1);
      if (one.routing.min_selection_gap < 1e-5) {
        ++redrawn;
        continue;
      }
      std::copy(row.begin(), row.end(), x.begin() + t * kHidden);
      break;
    }
  }
  EXPECT_LT(redrawn, T / 10) << "the gap filter would bias the case";

  Tensor xt = FromDoubles(x, {T, kHidden}, DType::kFloat32);
  absl::StatusOr<EngineStep> step = RunStep(cpu->layer.get(), xt, nullptr, 0, 0);
  ASSERT_TRUE(step.ok()) << step.status();
  RefForwardResult ref = RefForward(rc, params, x, T);

  EXPECT_EQ(step->forward.tokens_per_expert, ref.tokens_per_expert);
  const std::vector<double> out = ToDoubles(step->forward.out);
  int64_t wrong = 0, first_wrong = -1;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> a(out.begin() + t * kHidden, out.begin() + (t + 1) * kHidden);
    std::vector<double> b(ref.out.begin() + t * kHidden, ref.out.begin() + (t + 1) * kHidden);
    if (RelativeError(a, b) > 1e-4) {
      if (first_wrong < 0) first_wrong = t;
      ++wrong;
    }
  }
  EXPECT_EQ(wrong, 0) << "tokens routed differently from the reference, first: " << first_wrong
                      << (first_wrong % kZeroRowEvery == 0 ? " (an all-tie row)" : "");
  EXPECT_LE(RelativeError(out, ref.out), 1e-5);
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const auto& [shape, grouped, scaling, scoring] = info.param;
  static const char* kScoring[] = {"SoftmaxPost", "SoftmaxPre", "Sigmoid", "SigmoidBias"};
  return "T" + std::to_string(shape.tokens) + "E" + std::to_string(shape.experts) + "k" +
         std::to_string(shape.top_k) + (grouped ? "Grouped" : "") +
         (scaling == 1.0 ? "" : "Scaled") + kScoring[static_cast<int>(scoring)];
}

INSTANTIATE_TEST_SUITE_P(
    SpecShapes, RouterCasesTest,
    ::testing::Combine(::testing::Values(Shape{128, 32, 4}, Shape{2048, 32, 4}, Shape{2048, 128, 8},
                                         Shape{7168, 128, 4}, Shape{7168, 32, 8}),
                       ::testing::Bool(), ::testing::Values(1.0, 1.2),
                       ::testing::Values(Scoring::kSoftmaxPost, Scoring::kSoftmaxPre,
                                         Scoring::kSigmoid, Scoring::kSigmoidBias)),
    CaseName);

}  // namespace
}  // namespace moe_ref
