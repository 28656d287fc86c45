// server/step_memory.h against what the engine really allocates: single-process layers (the
// CPU backend counts its allocations) of several configs run a Forward and a Backward, and
// each step's peak above what the layer held before stays within ForwardStepBytes /
// BackwardStepBytes (Backward: plus the gradients it materialises the first time, which
// LayerBytesPerWorker counts as the layer's); layers deferring their weight gradients hold
// and allocate within the budget's terms. The admission test checks 2 workers.
#include "server/step_memory.h"

#include <cstdlib>

#include "gtest/gtest.h"
#include "proto/config_convert.h"
#include "proto/layer_info.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

struct Case {
  const char* name;
  v1::LayerConfig config;
  DType x_dtype;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  cases.push_back({"fp32", TinyConfig(1), DType::kFloat32});
  v1::LayerConfig bf16 = TinyConfig(2);
  bf16.set_compute_dtype("BF16");
  bf16.set_align_size(8);
  cases.push_back({"bf16 aligned", bf16, DType::kBFloat16});
  v1::LayerConfig capped = TinyConfig(3);
  capped.set_capacity_factor(1.0);
  capped.set_gated(false);
  cases.push_back({"capacity, not gated", capped, DType::kFloat32});
  v1::LayerConfig fp8 = TinyConfig(4);
  fp8.set_compute_dtype("FP8");
  cases.push_back({"fp8", fp8, DType::kBFloat16});
  return cases;
}

int64_t GradientBytes(const LayerConfig& config) {
  int64_t bytes = 0;
  for (const ParameterLayout& p : LayerParameters(config)) {
    if (p.has_gradient) bytes += NumElements(p.shape) * 4;
  }
  return bytes;
}

TEST(StepMemoryTest, StepsStayWithinTheirEstimates) {
  constexpr int64_t kTokens = 512;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    auto local = MakeLocalLayer(c.config);
    ASSERT_NE(local, nullptr);
    const LayerConfig config = *ConfigFromProto(c.config);
    Backend& backend = *local->backend;
    const Tensor x =
        Tensor::FromFloats({kTokens, 32}, RandomFloats(kTokens * 32, 5)).ConvertTo(c.x_dtype);

    const int64_t before_forward = backend.allocated_bytes();
    const int64_t peak_before = backend.peak_allocated_bytes();
    std::unique_ptr<StepContext> saved;
    ASSERT_TRUE(local->layer->Forward(x, &saved).ok());
    const int64_t forward_peak = backend.peak_allocated_bytes();
    ASSERT_GT(forward_peak, peak_before) << "the step did not set the peak: nothing measured";
    const int64_t forward_estimate = ForwardStepBytes(config, kTokens, 1, c.x_dtype);
    EXPECT_LE(forward_peak - before_forward, forward_estimate);
    std::printf("%s: forward peak %lld bytes, estimate %lld\n", c.name,
                static_cast<long long>(forward_peak - before_forward),
                static_cast<long long>(forward_estimate));

    const int64_t before_backward = backend.allocated_bytes();
    ASSERT_TRUE(local->layer->Backward(*saved, x, 1.0, 1.0).ok());
    const int64_t backward_peak = backend.peak_allocated_bytes();
    if (backward_peak > forward_peak) {
      EXPECT_LE(backward_peak - before_backward,
                BackwardStepBytes(config, kTokens, 1, c.x_dtype, kDefaultDeferredWgradFraction) +
                    GradientBytes(config));
    }
  }
}

// Backwards small enough to defer their weight gradients (a budget of the whole gradient's
// bytes: several steps' operands): what a deferring layer holds beyond an immediate one on the
// same steps stays below the budget LayerBytesPerWorker counts, and each backward's peak,
// the flushing ones included, within BackwardStepBytes, which the estimate without the flush
// term would not bound.
TEST(StepMemoryTest, DeferredWeightGradientsStayWithinTheirEstimates) {
  constexpr int64_t kTokens = 24;
  constexpr double kFraction = 1.0;
  const v1::LayerConfig proto = TinyConfig(11);
  const LayerConfig config = *ConfigFromProto(proto);
  MoeLayerOptions deferral, none;
  deferral.deferred_wgrad_fraction = kFraction;
  none.deferred_wgrad_fraction = 0;
  std::unique_ptr<LocalLayer> deferring = MakeLocalLayer(proto, deferral);
  std::unique_ptr<LocalLayer> immediate = MakeLocalLayer(proto, none);
  ASSERT_NE(deferring, nullptr);
  ASSERT_NE(immediate, nullptr);
  const int64_t budget = DeferredWgradBudgetBytes(config, 1, kFraction);
  ASSERT_EQ(LayerBytesPerWorker(config, 1, kFraction) - LayerBytesPerWorker(config, 1, 0), budget);
  const int64_t estimate = BackwardStepBytes(config, kTokens, 1, DType::kFloat32, kFraction);
  const int64_t without_flush = BackwardStepBytes(config, kTokens, 1, DType::kFloat32, 0);
  int deferred = 0, flushed = 0;
  int64_t held_before = 0, largest_peak = 0;
  for (int step = 0; step < 8; ++step) {
    SCOPED_TRACE(step);
    const Tensor x = Tensor::FromFloats({kTokens, 32}, RandomFloats(kTokens * 32, 20 + step));
    int64_t peak = 0;
    for (LocalLayer* local : {deferring.get(), immediate.get()}) {
      std::unique_ptr<StepContext> saved;
      ASSERT_TRUE(local->layer->Forward(x, &saved).ok());
      Backend& backend = *local->backend;
      const int64_t before_backward = static_cast<int64_t>(backend.allocated_bytes());
      const int64_t peak_before = static_cast<int64_t>(backend.peak_allocated_bytes());
      ASSERT_TRUE(local->layer->Backward(*saved, x, 1.0, 1.0).ok());
      const int64_t peak_after = static_cast<int64_t>(backend.peak_allocated_bytes());
      if (local == deferring.get() && peak_after > peak_before) {
        peak = peak_after - before_backward;
      }
    }
    const int64_t held = static_cast<int64_t>(deferring->backend->allocated_bytes()) -
                         static_cast<int64_t>(immediate->backend->allocated_bytes());
    EXPECT_GE(held, 0);
    EXPECT_LT(held, budget) << "deferred operands beyond the budget";
    deferred += held > held_before;
    flushed += held < held_before;
    held_before = held;
    // The first backward also materialises the gradients (counted as the layer's).
    EXPECT_LE(peak, estimate + (step == 0 ? GradientBytes(config) : 0));
    if (step > 0) largest_peak = std::max(largest_peak, peak);
  }
  EXPECT_GE(deferred, 2) << "the steps did not defer: the test proves nothing";
  EXPECT_GE(flushed, 1) << "no backward ran the deferred GEMMs";
  std::printf("deferred: budget %lld, largest later backward peak %lld, estimate %lld (%lld "
              "without the flush)\n",
              static_cast<long long>(budget), static_cast<long long>(largest_peak),
              static_cast<long long>(estimate), static_cast<long long>(without_flush));
  EXPECT_GT(largest_peak, without_flush)
      << "the flush needed no more than a plain backward: the flush term is untested";
}

}  // namespace
}  // namespace moe
