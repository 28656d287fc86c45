// server/step_memory.h against what the engine really allocates: single-process layers (the
// CPU backend counts its allocations) of several configs run a Forward and a Backward, and
// each step's peak above what the layer held before stays within ForwardStepBytes /
// BackwardStepBytes (Backward: plus the gradients it materialises the first time, which
// LayerBytesPerWorker counts as the layer's). The admission test checks 2 workers.
#include "server/step_memory.h"

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
                BackwardStepBytes(config, kTokens, 1, c.x_dtype) + GradientBytes(config));
    }
  }
}

}  // namespace
}  // namespace moe
