// FP8 (OCP 8-bit floating point, the formats of NVIDIA Hopper's tensor cores) on the host:
// round-to-nearest-even encoding with saturation, decoding, and the per-tensor scale of the
// compute_dtype = FP8 recipe (docs/SPEC.md "FP8"). The CPU backend emulates FP8 GEMMs with
// these; the CUDA kernels produce the same codes with __nv_cvt_float_to_fp8(..., SATFINITE).
//
//   e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity; S.1111.111 is NaN;
//         largest finite 448, smallest subnormal 2^-9.
//   e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; S.11111.00 is infinity, S.11111.xx
//         (xx != 0) NaN; largest finite 57344, smallest subnormal 2^-16.
//
//   const float scale = Fp8Scale(amax, DType::kFloat8E4M3);   // amax / 448
//   uint8_t q = FloatToFp8(x / scale, DType::kFloat8E4M3);
//   float back = Fp8ToFloat(q, DType::kFloat8E4M3) * scale;
#ifndef MOED_ENGINE_FP8_H_
#define MOED_ENGINE_FP8_H_

#include <cstdint>

#include "engine/dtype.h"

namespace moe {

// True for kFloat8E4M3 and kFloat8E5M2.
inline bool IsFp8(DType t) { return t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2; }

// Largest finite value: 448 (e4m3) or 57344 (e5m2).
float Fp8Max(DType fp8);

// The value of `code`: exact in float; NaN for NaN codes, +-inf for e5m2's infinities.
float Fp8ToFloat(uint8_t code, DType fp8);

// Rounds to the nearest representable value, ties to the even code; magnitudes above the
// largest finite value (infinity included) saturate to +-Fp8Max; NaN becomes S.1111111
// (0x7f | sign, NaN in both formats); -0 stays -0.
uint8_t FloatToFp8(float value, DType fp8);

// The dequantisation scale of a tensor whose largest magnitude is `amax` (NaNs ignored):
// amax / Fp8Max(fp8) in fp32, or 1 when that is not a finite normal float (all-zero tensor,
// infinities). Quantising is q = FloatToFp8(x / scale); the GEMM multiplies by the scales.
float Fp8Scale(float amax, DType fp8);

// Delayed scaling (engine/backend.h Fp8HistoryArgs, docs/SPEC.md "FP8"): from the ring
// `history` [len] with `steps` recorded, ldexp(A, margin) in fp32, A the largest of the
// min(steps, len) filled slots (most_recent: slot (steps - 1) % len; 0 when steps == 0).
float Fp8DelayedAmax(const float* history, int64_t len, int64_t steps, int margin,
                     bool most_recent);

}  // namespace moe

#endif  // MOED_ENGINE_FP8_H_
