#include "engine/fp8.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <limits>

namespace moe {
namespace {

int MantissaBits(DType fp8) { return fp8 == DType::kFloat8E4M3 ? 3 : 2; }
int ExponentBias(DType fp8) { return fp8 == DType::kFloat8E4M3 ? 7 : 15; }

// Code of the largest finite positive value: 0x7e (e4m3) or 0x7b (e5m2).
int MaxCode(DType fp8) { return fp8 == DType::kFloat8E4M3 ? 0x7e : 0x7b; }

// The finite non-negative values of a format, index = code (increasing with the code).
struct PositiveValues {
  std::array<double, 128> value;
  int count;  // MaxCode + 1
};

PositiveValues MakePositiveValues(DType fp8) {
  PositiveValues p{};
  p.count = MaxCode(fp8) + 1;
  for (int c = 0; c < p.count; ++c) p.value[c] = Fp8ToFloat(static_cast<uint8_t>(c), fp8);
  return p;
}

const PositiveValues& Positives(DType fp8) {
  static const PositiveValues e4m3 = MakePositiveValues(DType::kFloat8E4M3);
  static const PositiveValues e5m2 = MakePositiveValues(DType::kFloat8E5M2);
  return fp8 == DType::kFloat8E4M3 ? e4m3 : e5m2;
}

}  // namespace

float Fp8Max(DType fp8) { return fp8 == DType::kFloat8E4M3 ? 448.0f : 57344.0f; }

float Fp8ToFloat(uint8_t code, DType fp8) {
  const int mbits = MantissaBits(fp8), bias = ExponentBias(fp8);
  const int ebits = 7 - mbits;
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> mbits) & ((1 << ebits) - 1);
  const int mantissa = code & ((1 << mbits) - 1);
  float magnitude;
  if (fp8 == DType::kFloat8E4M3 && (code & 0x7f) == 0x7f) {
    return std::numeric_limits<float>::quiet_NaN();
  } else if (fp8 == DType::kFloat8E5M2 && exponent == 31) {
    if (mantissa != 0) return std::numeric_limits<float>::quiet_NaN();
    magnitude = std::numeric_limits<float>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), 1 - bias - mbits);
  } else {
    magnitude = std::ldexp(static_cast<float>((1 << mbits) + mantissa), exponent - bias - mbits);
  }
  return negative ? -magnitude : magnitude;
}

uint8_t FloatToFp8(float value, DType fp8) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return static_cast<uint8_t>(0x7f | sign);
  const double a = std::fabs(static_cast<double>(value));
  const PositiveValues& p = Positives(fp8);
  const int top = p.count - 1;
  if (a >= p.value[top]) return static_cast<uint8_t>(top | sign);  // saturate
  // p.value[lo] <= a < p.value[lo + 1]; the midpoint is exact in double.
  const int hi = static_cast<int>(std::upper_bound(p.value.begin(), p.value.begin() + p.count, a) -
                                  p.value.begin());
  const int lo = hi - 1;
  const double mid = 0.5 * (p.value[lo] + p.value[hi]);
  int code;
  if (a < mid) {
    code = lo;
  } else if (a > mid) {
    code = hi;
  } else {
    code = (lo % 2 == 0) ? lo : hi;  // tie: the even code
  }
  return static_cast<uint8_t>(code | sign);
}

float Fp8Scale(float amax, DType fp8) {
  const float scale = amax / Fp8Max(fp8);
  return std::isfinite(scale) && scale >= FLT_MIN ? scale : 1.0f;
}

float Fp8DelayedAmax(const float* history, int64_t len, int64_t steps, int margin,
                     bool most_recent) {
  float amax = 0.0f;
  if (steps > 0 && most_recent) {
    amax = history[(steps - 1) % len];
  } else {
    // max is exact and order-free (NaN ignored, as fmaxf): the ring's order does not matter.
    for (int64_t i = 0; i < std::min(steps, len); ++i) amax = std::fmax(amax, history[i]);
  }
  return std::ldexp(amax, margin);
}

}  // namespace moe
