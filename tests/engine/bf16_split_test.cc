// engine/cuda/bf16_split.h on the host: every float of the tested ranges is exactly the sum of
// its three bf16 parts, the parts are bf16 values with the bounds the split promises, and a dot
// product of bf16 values with fp32 values equals, exactly, the sum of the dot products with the
// parts (what lets the CUDA backend run an fp32 GEMM whose A is bf16 on bf16 tensor cores).
#include "engine/cuda/bf16_split.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace cuda {
namespace {

float Bf16Value(uint16_t bits) { return BitsFloat(static_cast<uint32_t>(bits) << 16); }

struct Parts {
  float hi, mid, lo;
};

Parts Split(float v) {
  uint16_t hi, mid, lo;
  SplitToBf16x3(v, &hi, &mid, &lo);
  return {Bf16Value(hi), Bf16Value(mid), Bf16Value(lo)};
}

// Floats of random sign, significand and exponent in [min_exp, max_exp] (binary exponents).
std::vector<float> RandomFloats(int count, int min_exp, int max_exp, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> significand(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(min_exp, max_exp);
  std::vector<float> out(count);
  for (float& v : out) {
    v = std::ldexp(significand(rng), exponent(rng)) * (rng() % 2 ? 1.0f : -1.0f);
  }
  return out;
}

TEST(Bf16SplitTest, EveryFloatIsTheExactSumOfItsParts) {
  std::vector<float> values = RandomFloats(200000, -110, 127, 1);
  const float edge[] = {0.0f,
                        -0.0f,
                        1.0f,
                        -1.0f,
                        std::numeric_limits<float>::max(),
                        -std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::min(),
                        std::nextafter(1.0f, 2.0f),
                        std::nextafter(1.0f, 0.0f),
                        16777215.0f,
                        BitsFloat(0x3f80ffffu),
                        BitsFloat(0x3f8000ffu),
                        BitsFloat(0x3fffffffu)};
  values.insert(values.end(), std::begin(edge), std::end(edge));
  for (float v : values) {
    const Parts p = Split(v);
    const double sum = static_cast<double>(p.hi) + p.mid + p.lo;  // exact in double
    ASSERT_EQ(sum, static_cast<double>(v)) << "v = " << v;
    ASSERT_TRUE(std::isfinite(p.hi)) << "a finite value must not round up to infinity: " << v;
    ASSERT_LE(std::fabs(p.mid), std::ldexp(std::fabs(v), -7)) << v;
    ASSERT_LE(std::fabs(p.lo), std::ldexp(std::fabs(v), -15)) << v;
    // The parts are what their bf16 bits say (nothing below bit 16 of the float is lost).
    uint16_t hi, mid, lo;
    SplitToBf16x3(v, &hi, &mid, &lo);
    ASSERT_EQ(FloatBits(p.hi) >> 16, hi);
    ASSERT_EQ(FloatBits(p.mid) >> 16, mid);
    ASSERT_EQ(FloatBits(p.lo) >> 16, lo);
  }
}

TEST(Bf16SplitTest, InfinitiesAndNanStayWhatTheyAre) {
  const float inf = std::numeric_limits<float>::infinity();
  Parts p = Split(inf);
  EXPECT_EQ(p.hi, inf);
  EXPECT_EQ(p.mid, 0.0f);
  EXPECT_EQ(p.lo, 0.0f);
  p = Split(-inf);
  EXPECT_EQ(p.hi, -inf);
  // NaN whose payload lies only in the low 16 bits (truncation alone would make it infinity).
  for (float nan :
       {std::numeric_limits<float>::quiet_NaN(), BitsFloat(0x7f800001u), BitsFloat(0xff800001u)}) {
    p = Split(nan);
    EXPECT_TRUE(std::isnan(p.hi)) << FloatBits(nan);
    EXPECT_EQ(p.mid, 0.0f);
    EXPECT_EQ(p.lo, 0.0f);
  }
}

TEST(Bf16SplitTest, ProductsWithBf16AreExactAndDotProductsAgree) {
  // Each product of a bf16 value with a part has at most 16 significant bits: exact in fp32.
  // So sum_i a_i b_i (computed exactly, in double) equals the sum of the three part sums.
  const int kLength = 4096;
  std::vector<float> a = RandomFloats(kLength, -20, 20, 2), b = RandomFloats(kLength, -30, 10, 3);
  for (float& v : a) v = BitsFloat(FloatBits(v) & 0xffff0000u);  // bf16 values
  double exact = 0, by_parts = 0;
  for (int i = 0; i < kLength; ++i) {
    const Parts p = Split(b[i]);
    for (float part : {p.hi, p.mid, p.lo}) {
      const float product = a[i] * part;
      ASSERT_EQ(static_cast<double>(product), static_cast<double>(a[i]) * part);
      by_parts += product;
    }
    exact += static_cast<double>(a[i]) * b[i];
  }
  // Both sums are of the same exact values, only grouped differently; double rounds each
  // addition, so compare to double's precision over the sum of magnitudes.
  double magnitude = 0;
  for (int i = 0; i < kLength; ++i) magnitude += std::fabs(static_cast<double>(a[i]) * b[i]);
  EXPECT_NEAR(by_parts, exact, magnitude * 1e-15);
}

}  // namespace
}  // namespace cuda
}  // namespace moe
