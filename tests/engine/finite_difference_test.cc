// The engine's gradients (fp32, CPU backend) against central finite differences of the
// double-precision reference forward, on every parameter and the input, for each score
// function, grouped top-k, biases on/off, gated/plain, each activation, align_size 0/16 and
// capacity on/off. Small shapes keep the whole suite to a few seconds.
//
// Inputs are drawn until every routing decision is well separated (gap > 1e-3), and the
// finite-difference driver verifies that no perturbation changed the routing: a change would
// put a kink inside the difference and make the comparison meaningless.
#include "tests/reference/finite_difference.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/reference/engine_adapter.h"
#include "tests/reference/reference_moe.h"

namespace moe_ref {
namespace {

using moe::Activation;
using moe::DType;
using moe::LayerConfig;
using moe::ScoreFunction;
using moe::Tensor;

struct FdCase {
  std::string name;
  ScoreFunction score = ScoreFunction::kSoftmax;
  bool pre_softmax = false;
  int64_t top_k = 2;
  int64_t num_groups = 0, group_topk = 0;
  bool expert_bias = false;
  double scaling = 1.0;
  bool bias = false;
  bool gated = true;
  Activation activation = Activation::kSilu;
  int64_t align = 0;
  double capacity = 0.0;
};

LayerConfig ConfigFor(const FdCase& fc) {
  LayerConfig c;
  c.hidden = 6;
  c.ffn = 4;
  c.num_experts = 8;
  c.top_k = fc.top_k;
  c.score_function = fc.score;
  c.pre_softmax = fc.pre_softmax;
  c.num_groups = fc.num_groups;
  c.group_topk = fc.group_topk;
  c.use_expert_bias = fc.expert_bias;
  c.scaling_factor = fc.scaling;
  c.use_bias = fc.bias;
  c.gated = fc.gated;
  c.activation = fc.activation;
  c.align_size = fc.align;
  c.capacity_factor = fc.capacity;
  c.aux_loss_coeff = 1e-2;
  c.z_loss_coeff = 1e-3;
  c.init_seed = 7;
  return c;
}

// fp32-representable values, so the engine and the reference see the same numbers.
std::vector<double> RoundToFloat(std::vector<double> v) {
  for (double& x : v) x = static_cast<float>(x);
  return v;
}

class FiniteDifferenceTest : public ::testing::TestWithParam<FdCase> {};

TEST_P(FiniteDifferenceTest, EngineGradientsMatchDifferences) {
  const LayerConfig config = ConfigFor(GetParam());
  SCOPED_TRACE(moe::ConfigToString(config));
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(config);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const RefConfig rc = FromLayerConfig(config);
  const int64_t T = 7, H = config.hidden;
  const double d_aux = 0.7, d_zl = 1.3;

  // Parameters: the engine's init, plus random biases so that their gradients are tested.
  std::mt19937_64 rng(1234);
  RefParams params = ReadParams(*cpu->layer).value();
  if (config.use_bias) {
    params.wi_bias = RoundToFloat(RandomNormal(params.wi_bias.size(), 0.2, &rng));
    params.wo_bias = RoundToFloat(RandomNormal(params.wo_bias.size(), 0.2, &rng));
  }
  if (config.use_expert_bias) {
    params.expert_bias = RoundToFloat(RandomNormal(params.expert_bias.size(), 0.05, &rng));
  }
  ASSERT_TRUE(WriteParams(params, cpu->layer.get()).ok());

  // Inputs with well-separated routing (and, with capacity, at least one drop).
  std::vector<double> x;
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 200) << "no well-separated input found";
    x = RoundToFloat(RandomNormal(T * H, 1.0, &rng));
    RefRouting r = RefForward(rc, params, x, T).routing;
    if (r.min_selection_gap < 1e-3 || r.min_capacity_gap < 1e-3) continue;
    if (config.capacity_factor > 0.0 && r.kept == r.selected) continue;
    break;
  }
  const std::vector<double> w_out = RoundToFloat(RandomNormal(T * H, 1.0, &rng));

  Tensor xt = FromDoubles(x, {T, H}, DType::kFloat32);
  Tensor d_out = FromDoubles(w_out, {T, H}, DType::kFloat32);
  absl::StatusOr<EngineStep> step = RunStep(cpu->layer.get(), xt, &d_out, d_aux, d_zl);
  ASSERT_TRUE(step.ok()) << step.status();
  RefGradients engine = ReadGradients(*cpu->layer).value();
  engine.d_x = ToDoubles(step->d_x);

  FdResult fd = FiniteDifferenceGradients(rc, params, x, T, w_out, d_aux, d_zl);
  ASSERT_FALSE(fd.routing_changed) << fd.detail;
  constexpr double kTol = 1e-4;
  EXPECT_LE(RelativeError(engine.d_x, fd.grads.d_x), kTol) << "x";
  EXPECT_LE(RelativeError(engine.d_gate, fd.grads.d_gate), kTol) << "gate";
  EXPECT_LE(RelativeError(engine.d_wi, fd.grads.d_wi), kTol) << "wi";
  EXPECT_LE(RelativeError(engine.d_wo, fd.grads.d_wo), kTol) << "wo";
  if (config.use_bias) {
    EXPECT_LE(RelativeError(engine.d_wi_bias, fd.grads.d_wi_bias), kTol) << "wi_bias";
    EXPECT_LE(RelativeError(engine.d_wo_bias, fd.grads.d_wo_bias), kTol) << "wo_bias";
  }
}

std::vector<FdCase> Cases() {
  std::vector<FdCase> cases;
  auto add = [&](const char* name, auto&& edit) {
    FdCase c;
    c.name = name;
    edit(c);
    cases.push_back(c);
  };
  add("SoftmaxPost", [](FdCase&) {});
  add("SoftmaxPreScaledBias", [](FdCase& c) {
    c.pre_softmax = true;
    c.scaling = 1.2;
    c.bias = true;
  });
  add("SoftmaxGrouped", [](FdCase& c) {
    c.num_groups = 4;
    c.group_topk = 2;
  });
  add("Sigmoid", [](FdCase& c) { c.score = ScoreFunction::kSigmoid; });
  add("SigmoidTop1", [](FdCase& c) {
    c.score = ScoreFunction::kSigmoid;
    c.top_k = 1;
  });
  add("SigmoidGroupedExpertBias", [](FdCase& c) {
    c.score = ScoreFunction::kSigmoid;
    c.expert_bias = true;
    c.num_groups = 4;
    c.group_topk = 2;
    c.top_k = 4;
  });
  add("GeluGatedBias", [](FdCase& c) {
    c.activation = Activation::kGelu;
    c.bias = true;
  });
  add("ReluPlainBias", [](FdCase& c) {
    c.activation = Activation::kRelu;
    c.gated = false;
    c.bias = true;
  });
  add("ReluGated", [](FdCase& c) { c.activation = Activation::kRelu; });
  add("LinearPlain", [](FdCase& c) {
    c.activation = Activation::kLinear;
    c.gated = false;
  });
  add("SiluPlain", [](FdCase& c) { c.gated = false; });
  add("GeluPlainAligned", [](FdCase& c) {
    c.activation = Activation::kGelu;
    c.gated = false;
    c.align = 16;
  });
  add("Aligned16Bias", [](FdCase& c) {
    c.align = 16;
    c.bias = true;
  });
  add("Capacity", [](FdCase& c) { c.capacity = 1.0; });
  add("CapacitySigmoidGroupedAligned", [](FdCase& c) {
    c.score = ScoreFunction::kSigmoid;
    c.num_groups = 4;
    c.group_topk = 2;
    c.capacity = 0.5;
    c.align = 16;
  });
  add("CapacityPreSoftmaxGeluBias", [](FdCase& c) {
    c.pre_softmax = true;
    c.activation = Activation::kGelu;
    c.capacity = 0.75;
    c.bias = true;
  });
  add("SoftmaxTop1", [](FdCase& c) { c.top_k = 1; });
  add("SoftmaxPreGroupedCapacity", [](FdCase& c) {
    c.pre_softmax = true;
    c.num_groups = 2;
    c.group_topk = 1;
    c.top_k = 3;
    c.capacity = 1.0;
  });
  add("SigmoidScaledExpertBiasGeluPlainBias", [](FdCase& c) {
    c.score = ScoreFunction::kSigmoid;
    c.expert_bias = true;
    c.scaling = 2.5;
    c.activation = Activation::kGelu;
    c.gated = false;
    c.bias = true;
    c.top_k = 3;
  });
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, FiniteDifferenceTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<FdCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace moe_ref
