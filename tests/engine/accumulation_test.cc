// Determinism and gradient accumulation of the CPU layer:
//  - two runs (fresh layers with one seed, or one layer twice) give bit-identical outputs,
//    input gradients and parameter gradients, in fp32 and bf16, at a size where the backend
//    runs multithreaded;
//  - two backwards accumulate into what one backward on the concatenated batch gives;
//  - ApplyOptimizer applies the accumulated gradients by the SGD/AdamW formulas (checked here
//    in double), refreshes the compute copies and zeroes the gradients; UpdateExpertBias
//    follows the counts accumulated over forwards.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reference/engine_adapter.h"
#include "tests/reference/finite_difference.h"

namespace moe_ref {
namespace {

using moe::DType;
using moe::LayerConfig;
using moe::Tensor;

LayerConfig MediumConfig(DType dtype) {
  LayerConfig c;
  c.hidden = 128;
  c.ffn = 256;
  c.num_experts = 8;
  c.top_k = 2;
  c.aux_loss_coeff = 1e-2;
  c.z_loss_coeff = 1e-3;
  c.capacity_factor = 1.25;
  c.align_size = 16;
  c.use_bias = true;
  c.compute_dtype = dtype;
  c.init_seed = 5;
  return c;
}

Tensor RandomTensor(int64_t rows, int64_t cols, uint64_t seed, DType dtype) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> v(rows * cols);
  for (double& x : v) x = dist(rng);
  return FromDoubles(v, {rows, cols}, dtype);
}

// Everything a step produces, as raw bytes.
std::vector<std::string> StepBytes(moe::MoeLayer* layer, const Tensor& x, const Tensor& d_out) {
  absl::StatusOr<EngineStep> step = RunStep(layer, x, &d_out, 1.0, 1.0);
  EXPECT_TRUE(step.ok()) << step.status();
  if (!step.ok()) return {};
  std::vector<std::string> bytes = {std::string(step->forward.out.bytes()),
                                    std::string(step->d_x.bytes())};
  bytes.push_back(std::to_string(step->forward.aux_loss) + "/" +
                  std::to_string(step->forward.z_loss));
  for (const std::string& name : layer->ParameterNames()) {
    if (name == "expert_bias") continue;
    absl::StatusOr<Tensor> g = layer->GetGradient(name);
    EXPECT_TRUE(g.ok()) << g.status();
    if (g.ok()) bytes.push_back(std::string(g->bytes()));
  }
  return bytes;
}

class DeterminismTest : public ::testing::TestWithParam<DType> {};

TEST_P(DeterminismTest, TwoRunsAreBitIdentical) {
  const LayerConfig c = MediumConfig(GetParam());
  const int64_t T = 1000;
  Tensor x = RandomTensor(T, c.hidden, 1, GetParam());
  Tensor d_out = RandomTensor(T, c.hidden, 2, GetParam());
  absl::StatusOr<CpuLayer> a = MakeCpuLayer(c);
  absl::StatusOr<CpuLayer> b = MakeCpuLayer(c);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<std::string> first = StepBytes(a->layer.get(), x, d_out);
  ASSERT_EQ(StepBytes(b->layer.get(), x, d_out), first) << "fresh layers differ";
  ASSERT_TRUE(a->layer->ZeroGradients().ok());
  ASSERT_EQ(StepBytes(a->layer.get(), x, d_out), first) << "the same layer twice differs";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DeterminismTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(moe::DTypeName(info.param));
                         });

// Concatenates two [T, H] tensors along the token dimension.
Tensor Concat(const Tensor& a, const Tensor& b) {
  std::vector<double> v = ToDoubles(a), w = ToDoubles(b);
  v.insert(v.end(), w.begin(), w.end());
  return FromDoubles(v, {a.dim(0) + b.dim(0), a.dim(1)}, a.dtype());
}

std::vector<std::vector<double>> Gradients(moe::MoeLayer& layer) {
  RefGradients g = ReadGradients(layer).value();
  return {g.d_gate, g.d_wi, g.d_wo, g.d_wi_bias, g.d_wo_bias};
}

// Two backwards accumulate like one on the concatenated batch. The aux loss, the z-loss and
// capacity are off on purpose: all three depend on T (1/T scaling, f counts, per-batch
// capacity), so two half batches are a different function from one whole batch.
TEST(AccumulationTest, TwoBackwardsEqualOneOnTheConcatenatedBatch) {
  LayerConfig c = MediumConfig(DType::kFloat32);
  c.aux_loss_coeff = 0.0;
  c.z_loss_coeff = 0.0;
  c.capacity_factor = 0.0;
  const int64_t T1 = 45, T2 = 38;
  Tensor x1 = RandomTensor(T1, c.hidden, 11, DType::kFloat32);
  Tensor x2 = RandomTensor(T2, c.hidden, 12, DType::kFloat32);
  Tensor d1 = RandomTensor(T1, c.hidden, 13, DType::kFloat32);
  Tensor d2 = RandomTensor(T2, c.hidden, 14, DType::kFloat32);

  absl::StatusOr<CpuLayer> split = MakeCpuLayer(c);
  absl::StatusOr<CpuLayer> whole = MakeCpuLayer(c);
  ASSERT_TRUE(split.ok() && whole.ok());
  // Both forwards first, backwards in reverse order: contexts are independent.
  std::unique_ptr<moe::StepContext> s1, s2;
  ASSERT_TRUE(split->layer->Forward(x1, &s1).ok());
  ASSERT_TRUE(split->layer->Forward(x2, &s2).ok());
  absl::StatusOr<Tensor> dx2 = split->layer->Backward(*s2, d2, 1.0, 1.0);
  absl::StatusOr<Tensor> dx1 = split->layer->Backward(*s1, d1, 1.0, 1.0);
  ASSERT_TRUE(dx1.ok() && dx2.ok());
  const std::vector<std::vector<double>> after_first_only = [&] {
    absl::StatusOr<CpuLayer> one = MakeCpuLayer(c);
    EXPECT_TRUE(RunStep(one->layer.get(), x1, &d1, 1.0, 1.0).ok());
    return Gradients(*one->layer);
  }();

  const Tensor d_whole = Concat(d1, d2);
  absl::StatusOr<EngineStep> step = RunStep(whole->layer.get(), Concat(x1, x2), &d_whole, 1.0, 1.0);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_LE(RelativeError(ToDoubles(Concat(*dx1, *dx2)), ToDoubles(step->d_x)), 1e-6);
  const auto accumulated = Gradients(*split->layer);
  const auto reference = Gradients(*whole->layer);
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_LE(RelativeError(accumulated[i], reference[i]), 1e-5) << "gradient " << i;
    EXPECT_GT(RelativeError(after_first_only[i], reference[i]), 1e-2)
        << "gradient " << i << ": the second batch contributes nothing, test is vacuous";
  }
}

TEST(AccumulationTest, ZeroGradientsRestartsAccumulation) {
  LayerConfig c = MediumConfig(DType::kFloat32);
  Tensor x = RandomTensor(30, c.hidden, 21, DType::kFloat32);
  Tensor d = RandomTensor(30, c.hidden, 22, DType::kFloat32);
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(c);
  ASSERT_TRUE(cpu.ok());
  ASSERT_TRUE(RunStep(cpu->layer.get(), x, &d, 1.0, 1.0).ok());
  const auto once = Gradients(*cpu->layer);
  ASSERT_TRUE(RunStep(cpu->layer.get(), x, &d, 1.0, 1.0).ok());
  const auto twice = Gradients(*cpu->layer);
  for (size_t i = 0; i < once.size(); ++i) {
    std::vector<double> doubled = once[i];
    for (double& v : doubled) v *= 2.0;
    EXPECT_LE(RelativeError(twice[i], doubled), 1e-6) << "gradient " << i;
  }
  ASSERT_TRUE(cpu->layer->ZeroGradients().ok());
  for (const auto& g : Gradients(*cpu->layer)) {
    for (double v : g) ASSERT_EQ(v, 0.0);
  }
}

// Zeroed gradients are zero lazily (the buffers keep the old bytes until the next backward
// writes them with beta = 0): a backward after ZeroGradients must give exactly a fresh layer's
// gradients, and an optimizer step with no backward since must see zeros.
TEST(AccumulationTest, ZeroedGradientsAreOverwrittenNotAddedTo) {
  const LayerConfig c = MediumConfig(DType::kBFloat16);
  Tensor x1 = RandomTensor(40, c.hidden, 41, DType::kFloat32);
  Tensor d1 = RandomTensor(40, c.hidden, 42, DType::kFloat32);
  Tensor x2 = RandomTensor(24, c.hidden, 43, DType::kFloat32);
  Tensor d2 = RandomTensor(24, c.hidden, 44, DType::kFloat32);
  absl::StatusOr<CpuLayer> a = MakeCpuLayer(c);
  absl::StatusOr<CpuLayer> b = MakeCpuLayer(c);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(RunStep(a->layer.get(), x1, &d1, 1.0, 1.0).ok());
  ASSERT_TRUE(a->layer->ZeroGradients().ok());
  EXPECT_EQ(StepBytes(a->layer.get(), x2, d2), StepBytes(b->layer.get(), x2, d2));

  // SGD with weight decay and no backward since the zeroing: p -= lr * wd * p.
  ASSERT_TRUE(a->layer->ZeroGradients().ok());
  const moe::OptimizerConfig sgd = moe::OptimizerConfig::Sgd(0.5, 0.0, 0.1);
  std::map<std::string, std::vector<double>> before;
  for (const std::string& name : a->layer->ParameterNames()) {
    before[name] = ToDoubles(a->layer->GetParameter(name).value());
  }
  ASSERT_TRUE(a->layer->ApplyOptimizer(sgd).ok());
  for (const auto& [name, p] : before) {
    std::vector<double> expected = p;
    if (name != "expert_bias") {
      for (double& v : expected) v -= sgd.lr * sgd.weight_decay * v;
    }
    EXPECT_LE(RelativeError(ToDoubles(a->layer->GetParameter(name).value()), expected), 1e-6)
        << name;
    if (name == "expert_bias") continue;
    for (double g : ToDoubles(a->layer->GetGradient(name).value())) ASSERT_EQ(g, 0.0);
  }
}

TEST(AccumulationTest, AContextServesOneBackwardOnly) {
  LayerConfig c = MediumConfig(DType::kFloat32);
  Tensor x = RandomTensor(8, c.hidden, 31, DType::kFloat32);
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(c);
  ASSERT_TRUE(cpu.ok());
  std::unique_ptr<moe::StepContext> saved;
  ASSERT_TRUE(cpu->layer->Forward(x, &saved).ok());
  ASSERT_TRUE(cpu->layer->Backward(*saved, x, 1.0, 1.0).ok());
  EXPECT_EQ(cpu->layer->Backward(*saved, x, 1.0, 1.0).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Deferred expert weight gradients (docs/SPEC.md "Weight gradients of several backwards"):
// MoeLayerOptions::deferred_wgrad_fraction, given when a layer is created, sets the budget as a
// fraction of wi and wo's gradient bytes. The tests compare layers with a large budget (every
// backward defers), a zero one (none does) and budgets set from a step's measured operand bytes.
absl::StatusOr<CpuLayer> MakeCpuLayerDeferring(const LayerConfig& c, double fraction) {
  moe::MoeLayerOptions options;
  options.deferred_wgrad_fraction = fraction;
  return MakeCpuLayer(c, options);
}

LayerConfig DeferralConfig(DType dtype) {
  LayerConfig c = MediumConfig(dtype);
  c.aux_loss_coeff = 0.0;  // as TwoBackwardsEqualOneOnTheConcatenatedBatch says why
  c.z_loss_coeff = 0.0;
  c.capacity_factor = 0.0;
  return c;
}

// Backend bytes wi and wo's gradients take.
size_t ExpertGradientBytes(const LayerConfig& c) {
  const int64_t up = c.gated ? 2 * c.ffn : c.ffn;
  return sizeof(float) * c.num_experts * (c.hidden * up + c.ffn * c.hidden);
}

// Forward and backward of one batch; the d_x bytes.
std::string Backward(moe::MoeLayer* layer, const Tensor& x, const Tensor& d_out) {
  std::unique_ptr<moe::StepContext> saved;
  EXPECT_TRUE(layer->Forward(x, &saved).ok());
  absl::StatusOr<Tensor> d_x = layer->Backward(*saved, d_out, 1.0, 1.0);
  EXPECT_TRUE(d_x.ok()) << d_x.status();
  return d_x.ok() ? std::string(d_x->bytes()) : "";
}

class DeferredWeightGradTest : public ::testing::TestWithParam<DType> {};

// One deferred backward runs, when flushed, the very GEMMs an immediate backward runs: the same
// bits. Until then the layer holds the operands' memory.
TEST_P(DeferredWeightGradTest, OneDeferredBackwardIsBitwiseTheImmediateOne) {
  const LayerConfig c = DeferralConfig(GetParam());
  Tensor x = RandomTensor(60, c.hidden, 51, GetParam());
  Tensor d = RandomTensor(60, c.hidden, 52, GetParam());
  absl::StatusOr<CpuLayer> deferring = MakeCpuLayerDeferring(c, 100);
  absl::StatusOr<CpuLayer> immediate = MakeCpuLayerDeferring(c, 0);
  ASSERT_TRUE(deferring.ok() && immediate.ok());
  EXPECT_EQ(Backward(deferring->layer.get(), x, d), Backward(immediate->layer.get(), x, d));
  EXPECT_GT(deferring->backend->allocated_bytes(), immediate->backend->allocated_bytes())
      << "nothing deferred: the test is vacuous";
  ASSERT_TRUE(deferring->layer->FlushGradients().ok());
  EXPECT_EQ(deferring->backend->allocated_bytes(), immediate->backend->allocated_bytes());
  for (const std::string& name : immediate->layer->ParameterNames()) {
    if (name == "expert_bias") continue;
    EXPECT_EQ(deferring->layer->GetGradient(name).value().bytes(),
              immediate->layer->GetGradient(name).value().bytes())
        << name;
  }
}

// Three deferred backwards become one GEMM per expert over their rows: another fp32 summation
// order than three accumulating GEMMs, the same sums (and the same d_x bits: only the weight
// gradients move), and what one backward on the concatenated batch gives.
TEST_P(DeferredWeightGradTest, SeveralBackwardsRunAsOneGemmOverTheirRows) {
  const LayerConfig c = DeferralConfig(GetParam());
  const int64_t rows[3] = {45, 38, 51};
  std::vector<Tensor> xs, ds;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(RandomTensor(rows[i], c.hidden, 61 + i, GetParam()));
    ds.push_back(RandomTensor(rows[i], c.hidden, 71 + i, GetParam()));
  }
  absl::StatusOr<CpuLayer> deferring = MakeCpuLayerDeferring(c, 100);
  absl::StatusOr<CpuLayer> immediate = MakeCpuLayerDeferring(c, 0);
  absl::StatusOr<CpuLayer> whole = MakeCpuLayerDeferring(c, 0);
  ASSERT_TRUE(deferring.ok() && immediate.ok() && whole.ok());
  size_t held = deferring->backend->allocated_bytes();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Backward(deferring->layer.get(), xs[i], ds[i]),
              Backward(immediate->layer.get(), xs[i], ds[i]))
        << "d_x of backward " << i;
    EXPECT_GT(deferring->backend->allocated_bytes(), held) << "backward " << i << " not deferred";
    held = deferring->backend->allocated_bytes();
  }
  const Tensor x_all = Concat(Concat(xs[0], xs[1]), xs[2]);
  const Tensor d_all = Concat(Concat(ds[0], ds[1]), ds[2]);
  ASSERT_TRUE(RunStep(whole->layer.get(), x_all, &d_all, 1.0, 1.0).ok());
  const auto deferred = Gradients(*deferring->layer);
  const auto accumulated = Gradients(*immediate->layer);
  const auto reference = Gradients(*whole->layer);
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_LE(RelativeError(deferred[i], accumulated[i]), 1e-6) << "gradient " << i;
    EXPECT_LE(RelativeError(deferred[i], reference[i]), 1e-5) << "gradient " << i;
  }
}

// The budget: a backward whose operands alone fill it runs its GEMMs at once (bitwise the
// immediate layer, no memory held); one that fits is deferred, and the backward that brings the
// deferred bytes to the budget runs them all.
TEST_P(DeferredWeightGradTest, TheBudgetBoundsTheDeferredBytes) {
  const LayerConfig c = DeferralConfig(GetParam());
  Tensor x = RandomTensor(64, c.hidden, 81, GetParam());
  Tensor d = RandomTensor(64, c.hidden, 82, GetParam());
  absl::StatusOr<CpuLayer> probe = MakeCpuLayerDeferring(c, 100);
  absl::StatusOr<CpuLayer> immediate = MakeCpuLayerDeferring(c, 0);
  ASSERT_TRUE(probe.ok() && immediate.ok());
  const size_t base = immediate->backend->allocated_bytes();
  Backward(probe->layer.get(), x, d);
  const size_t step_bytes = probe->backend->allocated_bytes() - base;  // one step's operands
  ASSERT_GT(step_bytes, 0u);
  auto fraction = [&](double budget_steps) {
    return budget_steps * static_cast<double>(step_bytes) /
           static_cast<double>(ExpertGradientBytes(c));
  };

  absl::StatusOr<CpuLayer> small = MakeCpuLayerDeferring(c, fraction(0.9));
  absl::StatusOr<CpuLayer> two = MakeCpuLayerDeferring(c, fraction(1.5));
  ASSERT_TRUE(small.ok() && two.ok());
  for (int i = 0; i < 3; ++i) {
    Backward(immediate->layer.get(), x, d);
    Backward(small->layer.get(), x, d);
    EXPECT_EQ(small->backend->allocated_bytes(), base) << "backward " << i;
    Backward(two->layer.get(), x, d);
    // 1 step deferred; 2 reach 1.5 steps' budget: flushed; then 1 again.
    EXPECT_EQ(two->backend->allocated_bytes(), i == 1 ? base : base + step_bytes)
        << "backward " << i;
  }
  const auto reference = Gradients(*immediate->layer);
  EXPECT_EQ(Gradients(*small->layer), reference);
  const auto flushed = Gradients(*two->layer);
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_LE(RelativeError(flushed[i], reference[i]), 1e-6) << "gradient " << i;
  }
}

// ZeroGradients drops the deferred operands (they would add to what is zeroed), and
// ApplyOptimizer runs them first.
TEST_P(DeferredWeightGradTest, ZeroingDropsAndTheOptimizerFlushes) {
  const LayerConfig c = DeferralConfig(GetParam());
  Tensor x1 = RandomTensor(40, c.hidden, 91, GetParam());
  Tensor d1 = RandomTensor(40, c.hidden, 92, GetParam());
  Tensor x2 = RandomTensor(33, c.hidden, 93, GetParam());
  Tensor d2 = RandomTensor(33, c.hidden, 94, GetParam());
  absl::StatusOr<CpuLayer> deferring = MakeCpuLayerDeferring(c, 100);
  absl::StatusOr<CpuLayer> immediate = MakeCpuLayerDeferring(c, 0);
  ASSERT_TRUE(deferring.ok() && immediate.ok());
  const size_t base = immediate->backend->allocated_bytes();
  Backward(deferring->layer.get(), x1, d1);
  ASSERT_TRUE(deferring->layer->ZeroGradients().ok());
  EXPECT_EQ(deferring->backend->allocated_bytes(), base);
  Backward(deferring->layer.get(), x2, d2);
  Backward(immediate->layer.get(), x2, d2);
  const moe::OptimizerConfig sgd = moe::OptimizerConfig::Sgd(0.5, 0.0, 0.1);
  ASSERT_TRUE(deferring->layer->ApplyOptimizer(sgd).ok());
  ASSERT_TRUE(immediate->layer->ApplyOptimizer(sgd).ok());
  EXPECT_EQ(deferring->backend->allocated_bytes(), immediate->backend->allocated_bytes());
  for (const std::string& name : immediate->layer->ParameterNames()) {
    EXPECT_EQ(deferring->layer->GetParameter(name).value().bytes(),
              immediate->layer->GetParameter(name).value().bytes())
        << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DeferredWeightGradTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(moe::DTypeName(info.param));
                         });

TEST(DeferredWeightGradTest, FP8NeverDefers) {
  LayerConfig c = DeferralConfig(DType::kFloat8E4M3);
  Tensor x = RandomTensor(48, c.hidden, 95, DType::kBFloat16);
  Tensor d = RandomTensor(48, c.hidden, 96, DType::kBFloat16);
  absl::StatusOr<CpuLayer> deferring = MakeCpuLayerDeferring(c, 100);
  absl::StatusOr<CpuLayer> immediate = MakeCpuLayerDeferring(c, 0);
  ASSERT_TRUE(deferring.ok() && immediate.ok()) << deferring.status();
  Backward(deferring->layer.get(), x, d);
  Backward(immediate->layer.get(), x, d);
  EXPECT_EQ(deferring->backend->allocated_bytes(), immediate->backend->allocated_bytes());
}

TEST(DeferredWeightGradTest, ABadFractionIsRefused) {
  for (double bad : {-1.0, -1e-300, std::nan(""), std::numeric_limits<double>::infinity()}) {
    absl::StatusOr<CpuLayer> cpu = MakeCpuLayerDeferring(MediumConfig(DType::kFloat32), bad);
    EXPECT_EQ(cpu.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    if (!cpu.ok()) {
      EXPECT_THAT(std::string(cpu.status().message()),
                  ::testing::HasSubstr("deferred_wgrad_fraction"));
    }
  }
}

// Expected masters after optimizer steps, computed in double from the gradients the layer
// reported before each step (the formulas of engine/backend.h OptimizerArgs).
struct Moments {
  std::vector<double> m, v;
};

void SgdStep(const moe::OptimizerConfig& o, const std::vector<double>& g, std::vector<double>* p,
             Moments* s) {
  s->m.resize(p->size(), 0.0);
  for (size_t i = 0; i < p->size(); ++i) {
    const double grad = g[i] + o.weight_decay * (*p)[i];
    s->m[i] = o.momentum * s->m[i] + grad;
    (*p)[i] -= o.lr * s->m[i];
  }
}

void AdamWStep(const moe::OptimizerConfig& o, int step, const std::vector<double>& g,
               std::vector<double>* p, Moments* s) {
  s->m.resize(p->size(), 0.0);
  s->v.resize(p->size(), 0.0);
  for (size_t i = 0; i < p->size(); ++i) {
    s->m[i] = o.beta1 * s->m[i] + (1 - o.beta1) * g[i];
    s->v[i] = o.beta2 * s->v[i] + (1 - o.beta2) * g[i] * g[i];
    const double m_hat = s->m[i] / (1 - std::pow(o.beta1, step));
    const double v_hat = s->v[i] / (1 - std::pow(o.beta2, step));
    (*p)[i] -= o.lr * (m_hat / (std::sqrt(v_hat) + o.eps) + o.weight_decay * (*p)[i]);
  }
}

class OptimizerTest : public ::testing::TestWithParam<bool /*adamw*/> {};

TEST_P(OptimizerTest, StepsFollowTheFormulaAndRefreshComputeCopies) {
  LayerConfig c = MediumConfig(DType::kBFloat16);
  c.hidden = 32;
  c.ffn = 48;
  const bool adamw = GetParam();
  moe::OptimizerConfig opt =
      adamw ? moe::OptimizerConfig::AdamW(1e-2, 0.1) : moe::OptimizerConfig::Sgd(1e-2, 0.9, 0.1);
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(c);
  ASSERT_TRUE(cpu.ok());
  std::map<std::string, std::vector<double>> expected;
  std::map<std::string, Moments> moments;
  for (const std::string& name : cpu->layer->ParameterNames()) {
    expected[name] = ToDoubles(cpu->layer->GetParameter(name).value());
  }
  for (int step = 1; step <= 3; ++step) {
    Tensor x = RandomTensor(40, c.hidden, 100 + step, DType::kFloat32);
    Tensor d = RandomTensor(40, c.hidden, 200 + step, DType::kFloat32);
    ASSERT_TRUE(RunStep(cpu->layer.get(), x, &d, 1.0, 1.0).ok());
    for (auto& [name, p] : expected) {
      if (name == "expert_bias") continue;
      const std::vector<double> g = ToDoubles(cpu->layer->GetGradient(name).value());
      if (adamw) {
        AdamWStep(opt, step, g, &p, &moments[name]);
      } else {
        SgdStep(opt, g, &p, &moments[name]);
      }
    }
    ASSERT_TRUE(cpu->layer->ApplyOptimizer(opt).ok());
    for (const auto& [name, p] : expected) {
      EXPECT_LE(RelativeError(ToDoubles(cpu->layer->GetParameter(name).value()), p), 1e-5)
          << name << " after step " << step;
      if (name == "expert_bias") continue;
      for (double g : ToDoubles(cpu->layer->GetGradient(name).value())) ASSERT_EQ(g, 0.0);
    }
  }
  // The bf16 compute copies follow the masters: a layer given the same masters computes the
  // same output bits.
  absl::StatusOr<CpuLayer> copy = MakeCpuLayer(c);
  ASSERT_TRUE(copy.ok());
  for (const std::string& name : cpu->layer->ParameterNames()) {
    ASSERT_TRUE(copy->layer->SetParameter(name, cpu->layer->GetParameter(name).value()).ok());
  }
  Tensor x = RandomTensor(40, c.hidden, 300, DType::kBFloat16);
  EXPECT_EQ(copy->layer->Forward(x, nullptr).value().out.bytes(),
            cpu->layer->Forward(x, nullptr).value().out.bytes());
}

INSTANTIATE_TEST_SUITE_P(Kinds, OptimizerTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "AdamW" : "SgdMomentum");
                         });

// SPEC Updates: b_e += rate * sign(mean(f) - f_e) over the counts of every forward since the
// last update; the counts then restart.
TEST(ExpertBiasTest, UpdateFollowsAccumulatedCounts) {
  LayerConfig c = MediumConfig(DType::kFloat32);
  c.score_function = moe::ScoreFunction::kSigmoid;
  c.use_expert_bias = true;
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(c);
  ASSERT_TRUE(cpu.ok());
  std::vector<int64_t> counts(c.num_experts, 0);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<moe::ForwardResult> r =
        cpu->layer->Forward(RandomTensor(50 + i, c.hidden, 400 + i, DType::kFloat32), nullptr);
    ASSERT_TRUE(r.ok());
    for (int64_t e = 0; e < c.num_experts; ++e) counts[e] += r->tokens_per_expert[e];
  }
  EXPECT_EQ(cpu->layer->accumulated_expert_counts(), counts);
  const std::vector<double> before = ToDoubles(cpu->layer->GetParameter("expert_bias").value());
  ASSERT_TRUE(cpu->layer->UpdateExpertBias(0.125).ok());
  const std::vector<double> after = ToDoubles(cpu->layer->GetParameter("expert_bias").value());
  double mean = 0;
  for (int64_t f : counts) mean += static_cast<double>(f) / c.num_experts;
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const double sign = mean > counts[e] ? 1.0 : (mean < counts[e] ? -1.0 : 0.0);
    EXPECT_DOUBLE_EQ(after[e], before[e] + 0.125 * sign) << "expert " << e;
  }
  EXPECT_EQ(cpu->layer->accumulated_expert_counts(), std::vector<int64_t>(c.num_experts, 0));
}

}  // namespace
}  // namespace moe_ref
