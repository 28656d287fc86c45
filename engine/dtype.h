// Element types of tensors and the bf16 <-> fp32 conversions every backend shares.
//
//   uint16_t b = FloatToBf16(1.5f);   // round to nearest even
//   float f = Bf16ToFloat(b);
#ifndef MOED_ENGINE_DTYPE_H_
#define MOED_ENGINE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

// Wire names follow KServe v2 / Triton ("FP32", "BF16", ...). The FP8 types (engine/fp8.h)
// never travel: they are the expert GEMM operands of compute_dtype = FP8 (kFloat8E4M3 is that
// compute dtype's value) and ParseDType does not accept them.
enum class DType { kFloat32, kBFloat16, kFloat64, kInt32, kInt64, kFloat8E4M3, kFloat8E5M2 };

size_t DTypeSize(DType dtype);
// "FP32", "BF16", "FP64", "INT32", "INT64", "FP8_E4M3", "FP8_E5M2"
const char* DTypeName(DType dtype);
// The wire datatypes only (FP32, BF16, FP64, INT32, INT64).
absl::StatusOr<DType> ParseDType(absl::string_view name);

inline float Bf16ToFloat(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Round to nearest, ties to even; NaN stays NaN.
inline uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace moe

#endif  // MOED_ENGINE_DTYPE_H_
