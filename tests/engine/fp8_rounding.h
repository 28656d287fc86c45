// The FP8 recipe's rounding of the expert weights, for tests that feed the fp64 reference the
// weights as the FP8 layer sees them (docs/SPEC.md "FP8", "Tolerances").
//
//   params.wi = moe_ref::RoundExpertsToE4M3(params.wi, config.num_experts);
#ifndef MOED_TESTS_ENGINE_FP8_ROUNDING_H_
#define MOED_TESTS_ENGINE_FP8_ROUNDING_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/fp8.h"

namespace moe_ref {

// Each expert's [rows, cols] block rounded as the FP8 recipe rounds the weights: per-expert
// scale amax / 448, e4m3 round to nearest even, decoded and rescaled.
inline std::vector<double> RoundExpertsToE4M3(const std::vector<double>& w, int64_t experts) {
  const moe::DType e4m3 = moe::DType::kFloat8E4M3;
  const size_t per = w.size() / experts;
  std::vector<double> out(w.size());
  for (int64_t e = 0; e < experts; ++e) {
    float amax = 0;
    for (size_t i = 0; i < per; ++i) {
      amax = std::fmax(amax, std::fabs(static_cast<float>(w[e * per + i])));
    }
    const float scale = moe::Fp8Scale(amax, e4m3);
    for (size_t i = 0; i < per; ++i) {
      const float v = static_cast<float>(w[e * per + i]);
      out[e * per + i] =
          static_cast<double>(moe::Fp8ToFloat(moe::FloatToFp8(v / scale, e4m3), e4m3)) * scale;
    }
  }
  return out;
}

}  // namespace moe_ref

#endif  // MOED_TESTS_ENGINE_FP8_ROUNDING_H_
