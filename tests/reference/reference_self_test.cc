// The reference checked on its own: hand-worked routing, capacity, aux and z-loss values, and
// its analytic gradients against central finite differences of its own forward.
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/reference/finite_difference.h"
#include "tests/reference/reference_moe.h"

namespace moe_ref {
namespace {

// A config whose gate is the identity (H = E), so x is the logits.
RefConfig LogitConfig(int64_t experts, int64_t k) {
  RefConfig c;
  c.hidden = experts;
  c.ffn = 2;
  c.num_experts = experts;
  c.top_k = k;
  return c;
}

RefParams IdentityGate(const RefConfig& c) {
  RefParams p = RefParams::Zeros(c);
  for (int64_t e = 0; e < c.num_experts; ++e) p.gate[e * c.num_experts + e] = 1.0;
  return p;
}

std::vector<int> Selected(const RefForwardResult& fwd, int64_t t, int64_t E) {
  std::vector<int> s;
  for (int64_t e = 0; e < E; ++e) {
    if (fwd.routing.selected[t * E + e]) s.push_back(static_cast<int>(e));
  }
  return s;
}

TEST(ReferenceRouting, TopKAndTiesTowardLowerIndex) {
  RefConfig c = LogitConfig(4, 2);
  RefParams p = IdentityGate(c);
  RefForwardResult fwd = RefForward(c, p, {1, 3, 3, 0, /*t1*/ 0, 0, 0, 0}, 2);
  EXPECT_EQ(Selected(fwd, 0, 4), (std::vector<int>{1, 2}));
  EXPECT_DOUBLE_EQ(fwd.routing.probs[1], 0.5);
  EXPECT_EQ(Selected(fwd, 1, 4), (std::vector<int>{0, 1}));
  EXPECT_EQ(fwd.tokens_per_expert, (std::vector<int64_t>{1, 2, 1, 0}));
}

TEST(ReferenceRouting, GroupedTopKKeepsBestGroup) {
  RefConfig c = LogitConfig(4, 2);
  c.num_groups = 2;
  c.group_topk = 1;
  RefParams p = IdentityGate(c);
  // Expert 0 alone is best, but group 1 (2 + 2) beats group 0 (5 - 5).
  RefForwardResult fwd = RefForward(c, p, {5, -5, 2, 2}, 1);
  EXPECT_EQ(Selected(fwd, 0, 4), (std::vector<int>{2, 3}));
}

TEST(ReferenceRouting, SigmoidWithExpertBiasSelectsOnBiasedScoreOnly) {
  RefConfig c = LogitConfig(4, 1);
  c.score = RefScore::kSigmoid;
  c.use_expert_bias = true;
  RefParams p = IdentityGate(c);
  p.expert_bias = {0, 0, 0, 1.0};
  RefForwardResult fwd = RefForward(c, p, {1, 0, 0, 0}, 1);
  EXPECT_EQ(Selected(fwd, 0, 4), (std::vector<int>{3}));
  EXPECT_DOUBLE_EQ(fwd.routing.probs[3], 0.5);  // k = 1: the unbiased sigmoid itself
}

TEST(ReferenceRouting, CapacityDropsLowestThenLaterToken) {
  RefConfig c = LogitConfig(2, 1);
  c.score = RefScore::kSigmoid;
  c.capacity_factor = 1.0;  // ceil(1 * 4 * 1 / 2) = 2 per expert
  RefParams p = IdentityGate(c);
  RefForwardResult fwd = RefForward(c, p, {2, -9, 1, -9, 2, -9, 2, -9}, 4);
  EXPECT_EQ(fwd.routing.capacity, 2);
  EXPECT_EQ(fwd.tokens_per_expert, (std::vector<int64_t>{4, 0}));  // before drops
  // probs 0.88, 0.73, 0.88, 0.88: token 1 is lowest, then token 3 is the later of the ties.
  std::vector<uint8_t> kept_e0 = {fwd.routing.kept[0], fwd.routing.kept[2], fwd.routing.kept[4],
                                  fwd.routing.kept[6]};
  EXPECT_EQ(kept_e0, (std::vector<uint8_t>{1, 0, 1, 0}));
}

TEST(ReferenceLosses, HandWorkedAuxAndZLoss) {
  RefConfig c = LogitConfig(2, 1);
  c.aux_loss_coeff = 0.25;
  c.z_loss_coeff = 0.5;
  RefParams p = IdentityGate(c);
  // z = 0: P = 1/2, both tokens pick expert 0, f = [2, 0], C = 2 * 0.25 / (1 * 4).
  RefForwardResult fwd = RefForward(c, p, {0, 0, 0, 0}, 2);
  EXPECT_DOUBLE_EQ(fwd.aux_loss, 0.125 * (1.0 * 2));
  EXPECT_NEAR(fwd.z_loss, 0.5 * std::log(2.0) * std::log(2.0), 1e-15);
}

TEST(ReferenceLosses, ZeroTokens) {
  RefConfig c = LogitConfig(4, 2);
  c.aux_loss_coeff = 0.1;
  c.z_loss_coeff = 0.1;
  RefForwardResult fwd = RefForward(c, IdentityGate(c), {}, 0);
  EXPECT_EQ(fwd.aux_loss, 0.0);
  EXPECT_EQ(fwd.z_loss, 0.0);
  EXPECT_TRUE(fwd.out.empty());
}

TEST(ReferenceActivations, DerivativesMatchDifferences) {
  for (RefActivation act :
       {RefActivation::kSilu, RefActivation::kGelu, RefActivation::kRelu, RefActivation::kLinear}) {
    for (double v : {-2.5, -0.3, 0.7, 3.1}) {
      double fd = (RefAct(act, v + 1e-6) - RefAct(act, v - 1e-6)) / 2e-6;
      EXPECT_NEAR(RefActGrad(act, v), fd, 1e-8) << static_cast<int>(act) << " at " << v;
    }
  }
  EXPECT_NEAR(RefAct(RefActivation::kGelu, 1.0), 0.8411919906082768, 1e-12);
}

// Random parameters; scales chosen so routing gaps are wide compared with the FD step.
RefParams RandomParams(const RefConfig& c, std::mt19937_64* rng) {
  std::normal_distribution<double> n(0.0, 1.0);
  RefParams p = RefParams::Zeros(c);
  for (double& v : p.gate) v = n(*rng);
  for (double& v : p.wi) v = n(*rng) / std::sqrt(static_cast<double>(c.hidden));
  for (double& v : p.wo) v = n(*rng) / std::sqrt(static_cast<double>(c.ffn));
  if (c.use_bias) {
    for (double& v : p.wi_bias) v = 0.1 * n(*rng);
    for (double& v : p.wo_bias) v = 0.1 * n(*rng);
  }
  if (c.use_expert_bias) {
    for (double& v : p.expert_bias) v = 0.05 * n(*rng);
  }
  return p;
}

void CheckGradients(const RefConfig& c, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  RefParams p = RandomParams(c, &rng);
  std::vector<double> x(tokens * c.hidden), w_out(tokens * c.hidden);
  for (double& v : x) v = n(rng);
  for (double& v : w_out) v = n(rng);
  RefForwardResult fwd = RefForward(c, p, x, tokens);
  ASSERT_GT(fwd.routing.min_selection_gap, 1e-3) << "near-tie input; pick another seed";
  ASSERT_GT(fwd.routing.min_capacity_gap, 1e-3) << "near-tie input; pick another seed";
  if (c.capacity_factor > 0.0) {
    ASSERT_NE(fwd.routing.kept, fwd.routing.selected) << "capacity drops nothing here";
  }
  RefGradients an = RefBackward(c, p, x, fwd, w_out, 0.7, 1.3);
  FdResult fd = FiniteDifferenceGradients(c, p, x, tokens, w_out, 0.7, 1.3);
  ASSERT_FALSE(fd.routing_changed) << fd.detail;
  EXPECT_LT(RelativeError(an.d_x, fd.grads.d_x), 1e-7) << c.ToString();
  EXPECT_LT(RelativeError(an.d_gate, fd.grads.d_gate), 1e-7) << c.ToString();
  EXPECT_LT(RelativeError(an.d_wi, fd.grads.d_wi), 1e-7) << c.ToString();
  EXPECT_LT(RelativeError(an.d_wo, fd.grads.d_wo), 1e-7) << c.ToString();
  if (c.use_bias) {
    EXPECT_LT(RelativeError(an.d_wi_bias, fd.grads.d_wi_bias), 1e-7) << c.ToString();
    EXPECT_LT(RelativeError(an.d_wo_bias, fd.grads.d_wo_bias), 1e-7) << c.ToString();
  }
}

RefConfig SmallConfig() {
  RefConfig c;
  c.hidden = 6;
  c.ffn = 5;
  c.num_experts = 8;
  c.top_k = 2;
  c.aux_loss_coeff = 0.1;
  c.z_loss_coeff = 0.05;
  return c;
}

TEST(ReferenceGradients, SoftmaxPostSelection) { CheckGradients(SmallConfig(), 7, 1); }

TEST(ReferenceGradients, SoftmaxPreSelectionGeluBiasScaled) {
  RefConfig c = SmallConfig();
  c.pre_softmax = true;
  c.activation = RefActivation::kGelu;
  c.use_bias = true;
  c.scaling_factor = 1.2;
  CheckGradients(c, 7, 2);
}

TEST(ReferenceGradients, SigmoidGroupedWithExpertBiasCapacity) {
  RefConfig c = SmallConfig();
  c.score = RefScore::kSigmoid;
  c.use_expert_bias = true;
  c.num_groups = 4;
  c.group_topk = 2;
  c.top_k = 4;
  c.capacity_factor = 1.0;
  CheckGradients(c, 9, 3);
}

TEST(ReferenceGradients, SigmoidTopOnePlainRelu) {
  RefConfig c = SmallConfig();
  c.score = RefScore::kSigmoid;
  c.top_k = 1;
  c.gated = false;
  c.activation = RefActivation::kRelu;
  c.use_bias = true;
  CheckGradients(c, 7, 4);
}

TEST(ReferenceGradients, LinearGatedCapacityPreSoftmax) {
  RefConfig c = SmallConfig();
  c.pre_softmax = true;
  c.activation = RefActivation::kLinear;
  c.capacity_factor = 0.5;
  CheckGradients(c, 11, 5);
}

}  // namespace
}  // namespace moe_ref
