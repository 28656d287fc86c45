// CPU backend kernels on tiny hand-checked cases (engine/backend.h contracts).
#include "engine/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

class CpuBackendTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend(2);
};

// Naive C = alpha op(A) op(B) + beta C in double.
std::vector<float> NaiveGemm(bool ta, bool tb, int m, int n, int k, const std::vector<float>& a,
                             const std::vector<float>& b, const std::vector<float>& c, float alpha,
                             float beta) {
  std::vector<float> out(c);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int p = 0; p < k; ++p) {
        const float av = ta ? a[p * m + i] : a[i * k + p];
        const float bv = tb ? b[j * k + p] : b[p * n + j];
        s += static_cast<double>(av) * bv;
      }
      out[i * n + j] = static_cast<float>(alpha * s + beta * c[i * n + j]);
    }
  }
  return out;
}

std::vector<float> Ramp(int n, float scale, float offset) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = std::sin(scale * i + offset);
  return v;
}

TEST_F(CpuBackendTest, GemmAllTransposesFp32) {
  const int m = 3, n = 5, k = 4;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      std::vector<float> a = Ramp(m * k, 0.7f, 0.1f), b = Ramp(k * n, 0.3f, 0.5f);
      std::vector<float> c = Ramp(m * n, 0.9f, 0.2f);
      const std::vector<float> expect = NaiveGemm(ta, tb, m, n, k, a, b, c, 1.5f, 1.0f);
      GemmArgs g;
      g.trans_a = ta, g.trans_b = tb, g.m = m, g.n = n, g.k = k;
      g.a = a.data(), g.lda = ta ? m : k;
      g.b = b.data(), g.ldb = tb ? k : n;
      g.c = c.data(), g.ldc = n;
      g.alpha = 1.5f, g.beta = 1.0f;
      ASSERT_TRUE(backend_->Gemm(g).ok());
      for (int i = 0; i < m * n; ++i) EXPECT_NEAR(c[i], expect[i], 1e-5) << ta << tb << i;
    }
  }
}

// A row of C = A B (A not transposed: rows are tokens) has the same bits whatever other rows
// share the call: moed merges several callers' tokens into one step (cpu_gemm.cc,
// RowBlockedSgemm). OpenBLAS alone fails this (M = 1 against M = 17, M = 64 against 128).
TEST_F(CpuBackendTest, RowsDoNotDependOnM) {
  const int rows = 300;
  for (const auto& [n, k] : {std::pair<int, int>{512, 256}, {8, 256}, {256, 512}, {64, 64}}) {
    const std::vector<float> a = Ramp(rows * k, 0.37f, 0.1f), b = Ramp(k * n, 0.11f, 0.5f);
    for (bool trans_b : {false, true}) {
      auto product = [&](int first, int m, float beta) {
        std::vector<float> c = Ramp(m * n, 0.9f, 0.2f);
        GemmArgs g;
        g.trans_b = trans_b, g.m = m, g.n = n, g.k = k;
        g.a = a.data() + static_cast<size_t>(first) * k, g.lda = k;
        g.b = b.data(), g.ldb = trans_b ? k : n;
        g.c = c.data(), g.ldc = n;
        g.beta = beta;
        EXPECT_TRUE(backend_->Gemm(g).ok());
        return c;
      };
      const std::vector<float> all = product(0, rows, 0.0f);
      for (const auto& [first, m] : {std::pair<int, int>{0, 1}, {5, 17}, {40, 64}, {3, 128},
                                     {100, 200}, {299, 1}}) {
        const std::vector<float> part = product(first, m, 0.0f);
        EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin() + first * n))
            << "n=" << n << " k=" << k << " trans_b=" << trans_b << " rows " << first << "+" << m;
      }
    }
  }
}

TEST_F(CpuBackendTest, GemmBf16OperandsAndOutput) {
  const int m = 2, n = 3, k = 4;
  std::vector<float> a = Ramp(m * k, 0.7f, 0.1f), b = Ramp(k * n, 0.3f, 0.5f);
  std::vector<uint16_t> a16(a.size()), b16(b.size()), c16(m * n);
  for (size_t i = 0; i < a.size(); ++i) a[i] = Bf16ToFloat(a16[i] = FloatToBf16(a[i]));
  for (size_t i = 0; i < b.size(); ++i) b[i] = Bf16ToFloat(b16[i] = FloatToBf16(b[i]));
  const std::vector<float> expect = NaiveGemm(false, true, m, n, k, a,
                                              /*b as [n, k]*/ b, std::vector<float>(m * n), 1, 0);
  GemmArgs g;
  g.trans_b = true, g.m = m, g.n = n, g.k = k;
  g.a = a16.data(), g.lda = k, g.b = b16.data(), g.ldb = k, g.c = c16.data(), g.ldc = n;
  g.ab_type = DType::kBFloat16, g.c_type = DType::kBFloat16;
  ASSERT_TRUE(backend_->Gemm(g).ok());
  for (int i = 0; i < m * n; ++i) EXPECT_EQ(c16[i], FloatToBf16(expect[i])) << i;
}

// GemmArgs::a_bf16 with a null a (Backend::GemmReadsBf16A): the fp32 GEMM of the widened
// values, bitwise what the fp32 copy gives (both layouts of A, a padded lda); refused for
// non-fp32 operands, and a GEMM with neither a nor a_bf16 is refused.
TEST_F(CpuBackendTest, GemmReadsABf16CopyWhenAIsNull) {
  ASSERT_TRUE(backend_->GemmReadsBf16A());
  const int m = 4, n = 3, k = 5, pad = 2;
  for (bool ta : {false, true}) {
    const int rows = ta ? k : m, cols = ta ? m : k, lda = cols + pad;
    std::vector<uint16_t> a16(rows * lda);
    std::vector<float> a32(rows * lda);
    const std::vector<float> values = Ramp(rows * lda, 0.37f, 0.2f);
    for (size_t i = 0; i < a16.size(); ++i) a32[i] = Bf16ToFloat(a16[i] = FloatToBf16(values[i]));
    const std::vector<float> b = Ramp(k * n, 0.3f, 0.5f), c0 = Ramp(m * n, 0.9f, 0.2f);
    std::vector<float> from_fp32 = c0, from_bf16 = c0;
    GemmArgs g;
    g.trans_a = ta, g.m = m, g.n = n, g.k = k, g.lda = lda, g.b = b.data(), g.ldb = n, g.ldc = n;
    g.alpha = 0.75f, g.beta = 0.5f;
    g.a = a32.data(), g.c = from_fp32.data();
    ASSERT_TRUE(backend_->Gemm(g).ok());
    g.a = nullptr, g.a_bf16 = a16.data(), g.c = from_bf16.data();
    ASSERT_TRUE(backend_->Gemm(g).ok());
    EXPECT_THAT(from_bf16, ElementsAreArray(from_fp32)) << "trans_a " << ta;
    g.a_bf16 = nullptr;
    EXPECT_EQ(backend_->Gemm(g).code(), absl::StatusCode::kInvalidArgument);
    g.a_bf16 = a16.data(), g.ab_type = DType::kBFloat16;
    EXPECT_EQ(backend_->Gemm(g).code(), absl::StatusCode::kInvalidArgument);
    // GroupedGemm refuses a_bf16 (as the CUDA backend does) before running any of its GEMMs.
    GemmArgs first = g;
    first.a = a32.data(), first.a_bf16 = nullptr, first.ab_type = DType::kFloat32;
    std::vector<float> untouched = c0;
    first.c = untouched.data();
    g.ab_type = DType::kFloat32, g.a = a32.data();
    const GemmArgs grouped[] = {first, g};
    EXPECT_EQ(backend_->GroupedGemm(grouped).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(untouched, ElementsAreArray(c0)) << "a GEMM ran before the refusal";
  }
}

TEST_F(CpuBackendTest, GemmEmptyK) {
  std::vector<float> c = {1, 2, 3, 4};
  GemmArgs g;
  g.m = 2, g.n = 2, g.k = 0, g.c = c.data(), g.ldc = 2, g.beta = 0.0f;
  ASSERT_TRUE(backend_->Gemm(g).ok());
  EXPECT_THAT(c, ElementsAre(0, 0, 0, 0));
  c = {1, 2, 3, 4};
  g.beta = 1.0f;
  ASSERT_TRUE(backend_->Gemm(g).ok());
  EXPECT_THAT(c, ElementsAre(1, 2, 3, 4));
  g.lda = -1, g.k = 2;
  EXPECT_EQ(backend_->Gemm(g).code(), absl::StatusCode::kInvalidArgument);
}

LayerConfig RouterConfig(int64_t experts, int64_t k) {
  LayerConfig c;
  c.hidden = 4, c.ffn = 4, c.num_experts = experts, c.top_k = k;
  return c;
}

struct RouterOut {
  std::vector<int32_t> expert;
  std::vector<float> weight, scores, lse;
  std::vector<int32_t> counts;
  std::vector<double> partials;
};

RouterOut Route(Backend* backend, const LayerConfig& c, const std::vector<float>& logits,
                const float* bias = nullptr) {
  const int64_t T = logits.size() / c.num_experts;
  RouterOut o;
  o.expert.resize(T * c.top_k), o.weight.resize(T * c.top_k);
  o.scores.resize(logits.size()), o.lse.resize(T);
  o.counts.resize(c.num_experts), o.partials.resize(c.num_experts + 1);
  RouterForwardArgs r;
  r.config = &c, r.tokens = T, r.logits = logits.data(), r.expert_bias = bias;
  r.topk_expert = o.expert.data(), r.topk_weight = o.weight.data();
  r.scores = o.scores.data(), r.logsumexp = o.lse.data();
  r.expert_counts = o.counts.data(), r.loss_partials = o.partials.data();
  EXPECT_TRUE(backend->RouterForward(r).ok());
  return o;
}

TEST_F(CpuBackendTest, RouterSoftmaxPostSelectionAndTies) {
  const LayerConfig c = RouterConfig(4, 2);
  // Token 0: top-2 of z is {2, 1} in slot order; token 1: all equal, ties -> lower index.
  const RouterOut o = Route(backend_.get(), c, {1, 2, 3, 0, 0.5f, 0.5f, 0.5f, 0.5f});
  EXPECT_THAT(o.expert, ElementsAre(2, 1, 0, 1));
  const double p0 = 1.0 / (1.0 + std::exp(-1.0));  // exp(3) / (exp(3) + exp(2))
  EXPECT_NEAR(o.weight[0], p0, 1e-6);
  EXPECT_NEAR(o.weight[1], 1 - p0, 1e-6);
  EXPECT_NEAR(o.weight[2], 0.5, 1e-6);
  EXPECT_THAT(o.counts, ElementsAre(1, 2, 1, 0));
  const double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + 1.0);
  EXPECT_NEAR(o.lse[0], lse0, 1e-6);
  EXPECT_NEAR(o.partials[2], std::exp(3.0 - lse0) + 0.25, 1e-6);  // sum_t softmax(z)[2]
  EXPECT_NEAR(o.partials[4], lse0 * lse0 + std::pow(0.5 + std::log(4.0), 2), 1e-5);
}

TEST_F(CpuBackendTest, RouterGroupedTopKUsesGroupSums) {
  LayerConfig c = RouterConfig(8, 4);
  c.num_groups = 4, c.group_topk = 2;  // group score = sum of its top 4/2 = 2 scores
  // Groups: {0.1,0.9}=1.0 {0.8,0.7}=1.5 {0,0.95}=0.95 {0.3,0.2}=0.5 -> keep groups 1 and 0.
  // Ungrouped top-4 would be {5, 1, 2, 3}; grouped it is {1, 2, 3, 0} (slot order).
  const RouterOut o = Route(backend_.get(), c, {0.1f, 0.9f, 0.8f, 0.7f, 0.0f, 0.95f, 0.3f, 0.2f});
  EXPECT_THAT(o.expert, ElementsAre(1, 2, 3, 0));
}

TEST_F(CpuBackendTest, RouterSigmoidWithBiasSelectsOnBiasButWeighsWithout) {
  LayerConfig c = RouterConfig(4, 2);
  c.score_function = ScoreFunction::kSigmoid, c.use_expert_bias = true;
  c.scaling_factor = 2.0;
  const std::vector<float> bias = {0, 0, 0, 1.0f};  // lifts expert 3 into the selection
  const RouterOut o = Route(backend_.get(), c, {0.0f, 1.0f, 2.0f, -1.0f}, bias.data());
  EXPECT_THAT(o.expert, ElementsAre(3, 2));  // 1 + sigmoid(-1) = 1.269 > sigmoid(2) = 0.881
  const double s2 = 1 / (1 + std::exp(-2.0)), s3 = 1 / (1 + std::exp(1.0));
  EXPECT_NEAR(o.weight[0], 2.0 * s3 / (s2 + s3), 1e-6);
  EXPECT_NEAR(o.weight[1], 2.0 * s2 / (s2 + s3), 1e-6);
}

TEST_F(CpuBackendTest, CapacityDropsLowestWeightsLaterTokensFirst) {
  // T=4, k=1, everything on expert 0; capacity 2 keeps token 1 (0.7) and token 0 (the
  // earliest of the 0.5 ties).
  const std::vector<int32_t> experts = {0, 0, 0, 0};
  const std::vector<float> weights = {0.5f, 0.7f, 0.5f, 0.5f};
  std::vector<uint8_t> kept(4);
  std::vector<int32_t> kept_counts(2);
  RoutePlanArgs p;
  p.tokens = 4, p.top_k = 1, p.num_experts = 2, p.capacity = 2;
  p.topk_expert = experts.data(), p.topk_weight = weights.data();
  p.kept = kept.data(), p.kept_counts = kept_counts.data();
  ASSERT_TRUE(backend_->RoutePlan(p).ok());
  EXPECT_THAT(kept, ElementsAre(1, 1, 0, 0));
  EXPECT_THAT(kept_counts, ElementsAre(2, 0));
  p.capacity = -1;
  ASSERT_TRUE(backend_->RoutePlan(p).ok());
  EXPECT_THAT(kept, ElementsAre(1, 1, 1, 1));
  EXPECT_THAT(kept_counts, ElementsAre(4, 0));
}

TEST_F(CpuBackendTest, PermuteIsStableAndPadded) {
  // T=3, k=2: (t0: e2, e0) (t1: e0, e1 dropped) (t2: e2, e1); align 4 -> offsets 0, 4, 8, 12.
  const std::vector<int32_t> experts = {2, 0, 0, 1, 2, 1};
  const std::vector<uint8_t> kept = {1, 1, 1, 0, 1, 1};
  const std::vector<int64_t> offsets = {0, 4, 8, 12};
  std::vector<int32_t> pair_row(6), row_token(12);
  PermuteArgs p;
  p.tokens = 3, p.top_k = 2, p.num_experts = 3, p.total_rows = 12;
  p.topk_expert = experts.data(), p.kept = kept.data(), p.expert_offsets = offsets.data();
  p.pair_row = pair_row.data(), p.row_token = row_token.data();
  ASSERT_TRUE(backend_->Permute(p).ok());
  EXPECT_THAT(pair_row, ElementsAre(8, 0, 1, -1, 9, 4));
  EXPECT_THAT(row_token, ElementsAre(0, 1, -1, -1, 2, -1, -1, -1, 0, 2, -1, -1));
  // Gather: padding rows are zero.
  const std::vector<float> x = {1, 10, 2, 20, 3, 30};  // [3, 2]
  std::vector<float> rows(24, -1);
  ASSERT_TRUE(backend_->GatherRows(x.data(), row_token.data(), 12, 2, DType::kFloat32, rows.data())
                  .ok());
  EXPECT_THAT(std::vector<float>(rows.begin(), rows.begin() + 6), ElementsAre(1, 10, 2, 20, 0, 0));
  EXPECT_THAT(std::vector<float>(rows.begin() + 16, rows.begin() + 20), ElementsAre(1, 10, 3, 30));
  // Too few rows for an expert is an error, not an overflow.
  const std::vector<int64_t> short_offsets = {0, 1, 2, 3};
  p.expert_offsets = short_offsets.data(), p.total_rows = 3;
  EXPECT_EQ(backend_->Permute(p).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, CombineAndItsBackward) {
  // Two tokens, k=2; rows: y[0]=(1,2) y[1]=(3,4) y[2]=(5,6); token 1's second pair dropped.
  const std::vector<float> y = {1, 2, 3, 4, 5, 6};
  const std::vector<int32_t> pair_row = {2, 0, 1, -1};
  const std::vector<float> w = {0.5f, 0.25f, 2.0f, 9.0f};
  std::vector<float> out(4);
  ASSERT_TRUE(backend_->CombineRows(y.data(), DType::kFloat32, pair_row.data(), w.data(), 2, 2, 2,
                                    out.data(), DType::kFloat32)
                  .ok());
  EXPECT_THAT(out, ElementsAre(0.5f * 5 + 0.25f * 1, 0.5f * 6 + 0.25f * 2, 6, 8));
  const std::vector<float> d_out = {1, -1, 2, 3};
  std::vector<float> d_y(8, 7.0f), d_w(4);
  ASSERT_TRUE(backend_->CombineBackward(d_out.data(), DType::kFloat32, y.data(), DType::kFloat32,
                                        pair_row.data(), w.data(), 2, 2, 2, 4, d_y.data(),
                                        d_w.data())
                  .ok());
  EXPECT_THAT(d_y, ElementsAre(0.25f, -0.25f, 4, 6, 0.5f, -0.5f, 0, 0));
  EXPECT_THAT(d_w, ElementsAre(5 - 6, 1 - 2, 2 * 3 + 3 * 4, 0));
}

TEST_F(CpuBackendTest, GatedSiluWithBiasAndBackward) {
  // One row per group, F=1, gated: h = [g | u] + bias[group].
  std::vector<float> h = {1.0f, 2.0f, 0.0f, 1.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.5f, -1.0f};
  const std::vector<int64_t> groups = {1, 1};
  std::vector<float> a(2);
  ActivationArgs args;
  args.rows = 2, args.ffn = 1, args.h = h.data(), args.a = a.data();
  args.up_bias = bias.data(), args.group_rows = groups;
  ASSERT_TRUE(backend_->ActivationForward(args).ok());
  const double silu1 = 1.0 / (1.0 + std::exp(-1.0));
  EXPECT_THAT(h, ElementsAre(1.0f, 2.0f, 0.5f, 0.0f));
  EXPECT_NEAR(a[0], silu1 * 2.0, 1e-6);
  EXPECT_NEAR(a[1], 0.0, 1e-7);
  const std::vector<float> d_a = {1.0f, 1.0f};
  std::vector<float> d_h(4);
  args.d_a = d_a.data(), args.d_h = d_h.data();
  ASSERT_TRUE(backend_->ActivationBackward(args).ok());
  const double s1 = 1.0 / (1.0 + std::exp(-1.0));
  EXPECT_NEAR(d_h[0], 2.0 * s1 * (1.0 + 1.0 * (1.0 - s1)), 1e-6);  // u * silu'(g)
  EXPECT_NEAR(d_h[1], silu1, 1e-6);                                 // silu(g)
  std::vector<float> d_bias(4, 1.0f);
  ASSERT_TRUE(backend_->GroupBiasGrad(d_h.data(), DType::kFloat32, 2, groups, d_bias.data()).ok());
  EXPECT_NEAR(d_bias[0], 1.0 + d_h[0], 1e-6);  // accumulates
  EXPECT_NEAR(d_bias[3], 1.0 + d_h[3], 1e-6);
}

TEST_F(CpuBackendTest, Optimizers) {
  std::vector<float> p = {1.0f}, g = {0.5f}, m = {0.0f}, v = {0.0f};
  Backend::OptimizerArgs sgd;
  sgd.lr = 0.1, sgd.momentum = 0.9;
  ASSERT_TRUE(backend_->OptimizerStep(sgd, p.data(), g.data(), m.data(), nullptr, 1).ok());
  EXPECT_FLOAT_EQ(m[0], 0.5f);
  EXPECT_FLOAT_EQ(p[0], 0.95f);
  ASSERT_TRUE(backend_->OptimizerStep(sgd, p.data(), g.data(), m.data(), nullptr, 1).ok());
  EXPECT_FLOAT_EQ(m[0], 0.95f);
  EXPECT_FLOAT_EQ(p[0], 0.95f - 0.095f);
  // AdamW step 1: m_hat = g, v_hat = g^2 -> p -= lr (sign(g) + wd p) (eps negligible).
  p = {1.0f}, m = {0.0f};
  Backend::OptimizerArgs adam;
  adam.adamw = true, adam.lr = 0.01, adam.weight_decay = 0.1, adam.step = 1;
  ASSERT_TRUE(backend_->OptimizerStep(adam, p.data(), g.data(), m.data(), v.data(), 1).ok());
  EXPECT_NEAR(p[0], 1.0 - 0.01 * (1.0 + 0.1), 1e-6);
  // grad_scale (data-parallel mean over ranks) scales the gradient, not the weight decay.
  p = {1.0f}, m = {0.0f}, v = {0.0f};
  Backend::OptimizerArgs scaled;
  scaled.lr = 0.1, scaled.weight_decay = 0.1, scaled.grad_scale = 0.25;
  ASSERT_TRUE(backend_->OptimizerStep(scaled, p.data(), g.data(), nullptr, nullptr, 1).ok());
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.1f * (0.125f + 0.1f));
  adam.grad_scale = 0.25;
  ASSERT_TRUE(backend_->OptimizerStep(adam, p.data(), g.data(), m.data(), v.data(), 1).ok());
  EXPECT_FLOAT_EQ(m[0], 0.1f * 0.125f);
  EXPECT_FLOAT_EQ(v[0], 0.001f * 0.125f * 0.125f);
}

TEST_F(CpuBackendTest, MemoryAccountingAndCopies) {
  const size_t before = backend_->allocated_bytes();
  {
    auto b = backend_->Allocate(1000);
    ASSERT_TRUE(b.ok());
    EXPECT_GE(backend_->allocated_bytes(), before + 1000);
    auto empty = backend_->Allocate(0);
    ASSERT_TRUE(empty.ok());
    EXPECT_NE(empty->data(), nullptr);
    const std::vector<float> src = {1.5f, -2.0f};
    ASSERT_TRUE(backend_->CopyFromHost(b->data(), src.data(), 8).ok());
    std::vector<uint16_t> half(2);
    ASSERT_TRUE(backend_->Convert(b->data(), DType::kFloat32, half.data(), DType::kBFloat16, 2).ok());
    EXPECT_THAT(half, ElementsAre(FloatToBf16(1.5f), FloatToBf16(-2.0f)));
    std::vector<char> rows = {'a', 'b', 'c', 'd', 'e', 'f'}, moved(6, '.');
    const std::vector<RowBlock> blocks = {{2, 0, 1}, {0, 1, 2}};
    ASSERT_TRUE(backend_->CopyRowBlocks(rows.data(), moved.data(), 2, blocks).ok());
    EXPECT_THAT(moved, ElementsAreArray({'e', 'f', 'a', 'b', 'c', 'd'}));
  }
  EXPECT_EQ(backend_->allocated_bytes(), before);
  EXPECT_GE(backend_->peak_allocated_bytes(), before + 1000);
}

// Sizes beyond OpenBLAS's 32-bit integers were truncated (m = 2^32 + 1 ran as m = 1 and
// reported success); they must be refused.
TEST_F(CpuBackendTest, GemmRejectsSizesBeyondBlasIntegers) {
  std::vector<float> a = {2}, b = {3}, c = {0};
  GemmArgs g;
  g.m = (int64_t{1} << 32) + 1, g.n = 1, g.k = 1;
  g.a = a.data(), g.lda = 1, g.b = b.data(), g.ldb = 1, g.c = c.data(), g.ldc = 1;
  EXPECT_EQ(backend_->Gemm(g).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c[0], 0.0f);
  g.m = 1, g.k = int64_t{1} << 31, g.lda = g.k;
  EXPECT_EQ(backend_->Gemm(g).code(), absl::StatusCode::kInvalidArgument);
  g.k = 1, g.lda = 1, g.ldc = (int64_t{1} << 32) + 1;
  EXPECT_EQ(backend_->Gemm(g).code(), absl::StatusCode::kInvalidArgument);
  g.ldc = 1;
  ASSERT_TRUE(backend_->Gemm(g).ok());
  EXPECT_EQ(c[0], 6.0f);
}

// A size near SIZE_MAX wrapped in the rounding to the alignment and returned a tiny block
// labelled with the huge size.
TEST_F(CpuBackendTest, AllocateRefusesSizesThatWouldWrap) {
  for (size_t bytes : {SIZE_MAX, SIZE_MAX - 10, SIZE_MAX - 63}) {
    auto b = backend_->Allocate(bytes);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << bytes;
  }
}

}  // namespace
}  // namespace moe
