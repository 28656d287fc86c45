// Test-only glue between the engine (LayerConfig, MoeLayer, Tensor) and the independent
// reference: config translation, parameter and gradient copies, and a CPU layer to test.
// The reference library itself does not depend on this or on anything in engine/.
//
//   ASSIGN_OR_RETURN(CpuLayer cpu, MakeCpuLayer(config));
//   ASSIGN_OR_RETURN(RefParams params, ReadParams(*cpu.layer));
//   RefForwardResult ref = RefForward(FromLayerConfig(config), params, ToDoubles(x), tokens);
#ifndef MOED_TESTS_REFERENCE_ENGINE_ADAPTER_H_
#define MOED_TESTS_REFERENCE_ENGINE_ADAPTER_H_

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/comm/communicator.h"
#include "engine/config.h"
#include "engine/moe_layer.h"
#include "engine/tensor.h"
#include "tests/reference/reference_moe.h"

namespace moe_ref {

RefConfig FromLayerConfig(const moe::LayerConfig& config);

// Elements of an FP32, BF16 or FP64 tensor as doubles.
std::vector<double> ToDoubles(const moe::Tensor& tensor);
// A tensor of `dtype` (FP32 or BF16; rounded to nearest) with the given values.
moe::Tensor FromDoubles(const std::vector<double>& values, std::vector<int64_t> shape,
                        moe::DType dtype);

// n independent draws of N(0, scale^2) from rng, in order (test inputs and weights).
std::vector<double> RandomNormal(int64_t n, double scale, std::mt19937_64* rng);

// The layer's parameters (every expert must be local: EP = 1).
absl::StatusOr<RefParams> ReadParams(const moe::MoeLayer& layer);
// Installs `params` (rounded to fp32) into the layer; biases only where the config has them.
absl::Status WriteParams(const RefParams& params, moe::MoeLayer* layer);
// The layer's accumulated gradients in the reference layout (d_x left empty; biases zero when
// the config has none).
absl::StatusOr<RefGradients> ReadGradients(moe::MoeLayer& layer);

// A single-rank layer on the CPU backend with the local communicator.
struct CpuLayer {
  std::unique_ptr<moe::Backend> backend;
  std::unique_ptr<moe::Communicator> comm;
  std::unique_ptr<moe::MoeLayer> layer;
};
absl::StatusOr<CpuLayer> MakeCpuLayer(const moe::LayerConfig& config,
                                      const moe::MoeLayerOptions& options = {});

// One engine step: forward, and backward when d_out is given (gradients accumulate).
struct EngineStep {
  moe::ForwardResult forward;
  moe::Tensor d_x;
};
absl::StatusOr<EngineStep> RunStep(moe::MoeLayer* layer, const moe::Tensor& x,
                                   const moe::Tensor* d_out, double d_aux, double d_zl);

}  // namespace moe_ref

#endif  // MOED_TESTS_REFERENCE_ENGINE_ADAPTER_H_
