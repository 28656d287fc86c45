// FP8 codec (engine/fp8.h) and the CPU backend's FP8 kernels: every code round-trips, rounding
// is to the nearest value with ties to the even code, saturation, NaN, signed zero, the
// per-tensor scale, and QuantizeFp8 (as stored, transposed, grouped transposed) / FP8 Gemm on
// the CPU backend against a direct computation, with the weight-gradient GEMM on grouped codes.
#include "engine/fp8.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "engine/cpu/cpu_backend.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

constexpr DType kE4M3 = DType::kFloat8E4M3;
constexpr DType kE5M2 = DType::kFloat8E5M2;

bool IsNanCode(uint8_t code, DType fp8) { return std::isnan(Fp8ToFloat(code, fp8)); }

TEST(Fp8Codec, EveryCodeRoundTrips) {
  for (DType fp8 : {kE4M3, kE5M2}) {
    int nans = 0, infinities = 0;
    for (int c = 0; c < 256; ++c) {
      const uint8_t code = static_cast<uint8_t>(c);
      const float v = Fp8ToFloat(code, fp8);
      SCOPED_TRACE(testing::Message() << DTypeName(fp8) << " code " << c << " value " << v);
      if (std::isnan(v)) {
        ++nans;
        EXPECT_TRUE(IsNanCode(FloatToFp8(v, fp8), fp8));
      } else if (std::isinf(v)) {
        ++infinities;  // saturates (SATFINITE)
        EXPECT_EQ(FloatToFp8(v, fp8), (c & 0x80) | (fp8 == kE4M3 ? 0x7e : 0x7b));
      } else {
        EXPECT_EQ(FloatToFp8(v, fp8), code);
      }
    }
    EXPECT_EQ(nans, fp8 == kE4M3 ? 2 : 6);
    EXPECT_EQ(infinities, fp8 == kE4M3 ? 0 : 2);
  }
}

TEST(Fp8Codec, KnownValues) {
  EXPECT_EQ(Fp8ToFloat(0x38, kE4M3), 1.0f);
  EXPECT_EQ(Fp8ToFloat(0x7e, kE4M3), 448.0f);
  EXPECT_EQ(Fp8ToFloat(0x01, kE4M3), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8ToFloat(0x08, kE4M3), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(Fp8ToFloat(0xb8, kE4M3), -1.0f);
  EXPECT_EQ(Fp8ToFloat(0x3c, kE5M2), 1.0f);
  EXPECT_EQ(Fp8ToFloat(0x7b, kE5M2), 57344.0f);
  EXPECT_EQ(Fp8ToFloat(0x01, kE5M2), std::ldexp(1.0f, -16));
  EXPECT_EQ(Fp8ToFloat(0x7c, kE5M2), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Fp8Max(kE4M3), 448.0f);
  EXPECT_EQ(Fp8Max(kE5M2), 57344.0f);
}

TEST(Fp8Codec, TiesGoToTheEvenCode) {
  // e4m3 between 1 (0x38) and 1.125 (0x39): even is 0x38; between 1.125 and 1.25: 0x3a.
  EXPECT_EQ(FloatToFp8(1.0625f, kE4M3), 0x38);
  EXPECT_EQ(FloatToFp8(1.1875f, kE4M3), 0x3a);
  EXPECT_EQ(FloatToFp8(std::nextafter(1.0625f, 2.0f), kE4M3), 0x39);
  EXPECT_EQ(FloatToFp8(std::nextafter(1.1875f, 0.0f), kE4M3), 0x39);
  // Subnormals: half the smallest subnormal rounds to 0, 1.5 of it to 2 * 2^-9.
  EXPECT_EQ(FloatToFp8(std::ldexp(1.0f, -10), kE4M3), 0x00);
  EXPECT_EQ(FloatToFp8(std::ldexp(3.0f, -10), kE4M3), 0x02);
  EXPECT_EQ(FloatToFp8(std::nextafter(std::ldexp(1.0f, -10), 1.0f), kE4M3), 0x01);
  // e5m2 between 1 (0x3c) and 1.25 (0x3d): 0x3c; between 1.25 and 1.5: 0x3e.
  EXPECT_EQ(FloatToFp8(1.125f, kE5M2), 0x3c);
  EXPECT_EQ(FloatToFp8(1.375f, kE5M2), 0x3e);
  EXPECT_EQ(FloatToFp8(-1.375f, kE5M2), 0xbe);
  EXPECT_EQ(FloatToFp8(std::ldexp(1.0f, -17), kE5M2), 0x00);
}

TEST(Fp8Codec, SaturatesAndKeepsNanAndSignedZero) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FloatToFp8(449.0f, kE4M3), 0x7e);
  EXPECT_EQ(FloatToFp8(464.0f, kE4M3), 0x7e);  // max + half an ulp
  EXPECT_EQ(FloatToFp8(1e30f, kE4M3), 0x7e);
  EXPECT_EQ(FloatToFp8(-1e30f, kE4M3), 0xfe);
  EXPECT_EQ(FloatToFp8(inf, kE4M3), 0x7e);
  EXPECT_EQ(FloatToFp8(-inf, kE4M3), 0xfe);
  EXPECT_EQ(FloatToFp8(61440.0f, kE5M2), 0x7b);
  EXPECT_EQ(FloatToFp8(inf, kE5M2), 0x7b);
  EXPECT_EQ(FloatToFp8(-inf, kE5M2), 0xfb);
  EXPECT_EQ(FloatToFp8(nan, kE4M3), 0x7f);
  EXPECT_EQ(FloatToFp8(-nan, kE4M3), 0xff);
  EXPECT_TRUE(IsNanCode(FloatToFp8(nan, kE5M2), kE5M2));
  EXPECT_EQ(FloatToFp8(0.0f, kE4M3), 0x00);
  EXPECT_EQ(FloatToFp8(-0.0f, kE4M3), 0x80);
  EXPECT_EQ(FloatToFp8(-0.0f, kE5M2), 0x80);
  EXPECT_EQ(FloatToFp8(-std::ldexp(1.0f, -12), kE4M3), 0x80);  // underflows to -0
}

// Against a brute-force search over every finite value: nearest, ties to the even code.
TEST(Fp8Codec, RoundsToNearestOverRandomFloats) {
  std::mt19937_64 rng(16);
  for (DType fp8 : {kE4M3, kE5M2}) {
    const int max_code = fp8 == kE4M3 ? 0x7e : 0x7b;
    for (int i = 0; i < 20000; ++i) {
      const float v = std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng),
                                 std::uniform_int_distribution<int>(-20, 17)(rng));
      const double a = std::fabs(static_cast<double>(v));
      int best = 0;
      for (int c = 1; c <= max_code; ++c) {
        const double d = std::fabs(Fp8ToFloat(static_cast<uint8_t>(c), fp8) - a);
        const double db = std::fabs(Fp8ToFloat(static_cast<uint8_t>(best), fp8) - a);
        if (d < db || (d == db && c % 2 == 0)) best = c;
      }
      if (a > Fp8Max(fp8)) best = max_code;
      const int expected = best | (std::signbit(v) ? 0x80 : 0);
      ASSERT_EQ(FloatToFp8(v, fp8), expected) << DTypeName(fp8) << " " << v;
    }
  }
}

TEST(Fp8Codec, ScaleIsAmaxOverMaxOrOne) {
  EXPECT_EQ(Fp8Scale(448.0f, kE4M3), 1.0f);
  EXPECT_EQ(Fp8Scale(3.5f, kE4M3), 3.5f / 448.0f);
  EXPECT_EQ(Fp8Scale(57344.0f * 2, kE5M2), 2.0f);
  EXPECT_EQ(Fp8Scale(0.0f, kE4M3), 1.0f);
  EXPECT_EQ(Fp8Scale(std::numeric_limits<float>::infinity(), kE4M3), 1.0f);
  EXPECT_EQ(Fp8Scale(std::numeric_limits<float>::quiet_NaN(), kE4M3), 1.0f);
  EXPECT_EQ(Fp8Scale(1e-40f, kE4M3), 1.0f);  // the scale would be subnormal
}

TEST(CpuFp8, QuantizeWritesCodesAndPerMatrixScales) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  const int64_t batch = 2, rows = 3, cols = 5;
  std::vector<float> src(batch * rows * cols);
  std::mt19937_64 rng(3);
  for (float& v : src) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  src[7] = std::numeric_limits<float>::quiet_NaN();  // ignored by amax, stays NaN
  src[20] = -100.0f;                                 // matrix 1's amax
  for (bool transpose : {false, true}) {
    for (DType fp8 : {kE4M3, kE5M2}) {
      std::vector<uint8_t> dst(src.size());
      std::vector<float> scale(batch);
      QuantizeArgs q;
      q.src = src.data(), q.src_type = DType::kFloat32;
      q.batch = batch, q.rows = rows, q.cols = cols, q.transpose = transpose, q.fp8 = fp8;
      q.dst = dst.data(), q.scale = scale.data();
      ASSERT_TRUE(backend->QuantizeFp8(q).ok());
      for (int64_t b = 0; b < batch; ++b) {
        float amax = 0;
        for (int64_t i = 0; i < rows * cols; ++i)
          amax = std::fmax(amax, std::fabs(src[b * rows * cols + i]));
        EXPECT_EQ(scale[b], Fp8Scale(amax, fp8));
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t at = b * rows * cols + (transpose ? c * rows + r : r * cols + c);
            EXPECT_EQ(dst[at], FloatToFp8(src[b * rows * cols + r * cols + c] / scale[b], fp8));
          }
        }
      }
      EXPECT_EQ(scale[1], 100.0f / Fp8Max(fp8));
    }
  }
}

TEST(CpuFp8, GemmIsScaledProductOfDecodedOperands) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  const int64_t m = 7, n = 5, k = 33;
  std::mt19937_64 rng(4);
  std::vector<uint8_t> a(m * k), b(n * k);
  for (uint8_t& v : a) v = static_cast<uint8_t>(rng() % 256);
  for (uint8_t& v : b) v = static_cast<uint8_t>(rng() % 256);
  for (uint8_t& v : a)
    if (IsNanCode(v, kE5M2)) v = 0x11;
  for (uint8_t& v : b)
    if (IsNanCode(v, kE4M3)) v = 0x22;
  for (uint8_t& v : a)
    if ((v & 0x7f) == 0x7c) v = 0x33;  // no e5m2 infinities
  alignas(16) const float sa = 0.25f;  // FP8 GEMM scales are 16-byte aligned (backend.h)
  alignas(16) const float sb = 3.0f;
  for (DType c_type : {DType::kFloat32, DType::kBFloat16}) {
    std::vector<float> c32(m * n, 0.0f);
    std::vector<uint16_t> c16(m * n, 0);
    GemmArgs g;
    g.trans_b = true;
    g.m = m, g.n = n, g.k = k;
    g.a = a.data(), g.lda = k, g.b = b.data(), g.ldb = k;
    g.c = c_type == DType::kFloat32 ? static_cast<void*>(c32.data()) : c16.data(), g.ldc = n;
    g.c_type = c_type, g.alpha = 2.0f;
    g.a_fp8 = kE5M2, g.b_fp8 = kE4M3, g.a_scale = &sa, g.b_scale = &sb;
    ASSERT_TRUE(backend->Gemm(g).ok());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double want = 0, mag = 0;
        for (int64_t p = 0; p < k; ++p) {
          const double t = static_cast<double>(Fp8ToFloat(a[i * k + p], kE5M2)) *
                           Fp8ToFloat(b[j * k + p], kE4M3);
          want += t;
          mag += std::fabs(t);
        }
        want *= 2.0 * sa * sb;
        mag *= 2.0 * sa * sb;
        const double got = c_type == DType::kFloat32 ? c32[i * n + j] : Bf16ToFloat(c16[i * n + j]);
        const double tol =
            c_type == DType::kFloat32 ? 1e-6 * mag : 1e-2 * std::fabs(want) + 1e-6 * mag;
        EXPECT_NEAR(got, want, tol) << i << "," << j;
      }
    }
  }
  // Wrong shapes are refused: FP8 only as A . B^T, never both e5m2.
  GemmArgs bad;
  bad.m = bad.n = bad.k = 1;
  bad.a = a.data(), bad.b = b.data(), bad.lda = bad.ldb = bad.ldc = 1;
  float c = 0;
  bad.c = &c;
  bad.a_fp8 = kE4M3, bad.b_fp8 = kE4M3, bad.a_scale = &sa, bad.b_scale = &sb;
  EXPECT_FALSE(backend->Gemm(bad).ok());  // trans_b false
  bad.trans_b = true;
  EXPECT_TRUE(backend->Gemm(bad).ok());
  alignas(16) float scales[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  bad.b_scale = scales + 1;  // not 16-byte aligned: cuBLASLt would refuse it, so does the CPU
  EXPECT_FALSE(backend->Gemm(bad).ok());
  bad.b_scale = scales + kFp8ScaleStride;
  EXPECT_TRUE(backend->Gemm(bad).ok());
  bad.a_fp8 = bad.b_fp8 = kE5M2;
  EXPECT_FALSE(backend->Gemm(bad).ok());
}

// Experts' row groups, empty ones included, none a multiple of 16 but one.
const std::vector<int64_t> kGroupRows = {5, 0, 16, 1, 0, 17};

// Row-major [rows, cols] bf16 values with a NaN and a large one (its sign kept).
std::vector<uint16_t> GroupedSource(int64_t rows, int64_t cols) {
  std::mt19937_64 rng(5);
  std::vector<uint16_t> src(rows * cols);
  for (uint16_t& v : src) v = FloatToBf16(std::normal_distribution<float>(0.0f, 2.0f)(rng));
  src[3] = FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  src[40] = FloatToBf16(-75.0f);
  return src;
}

// The grouped transposed layout (QuantizeArgs::dst_grouped_t) holds the codes as stored,
// regrouped: each group 16-aligned, zero pads, empty groups take no columns; same scale.
TEST(CpuFp8, GroupedTransposedCodesAreTheRowCodesRegrouped) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  const int64_t rows = 39, cols = 24;
  const int64_t ld = Fp8GroupedColumns(kGroupRows);
  ASSERT_EQ(ld, 16 + 0 + 16 + 16 + 0 + 32);
  const std::vector<uint16_t> src = GroupedSource(rows, cols);
  for (bool with_rows : {true, false}) {
    std::vector<uint8_t> plain(rows * cols), dst(rows * cols, 0xab), grouped(cols * ld, 0xab);
    alignas(16) float plain_scale[4] = {}, scale[4] = {};
    QuantizeArgs q;
    q.src = src.data(), q.src_type = DType::kBFloat16, q.rows = rows, q.cols = cols;
    q.dst = plain.data(), q.scale = plain_scale;
    ASSERT_TRUE(backend->QuantizeFp8(q).ok());
    q.dst = with_rows ? dst.data() : nullptr, q.scale = scale;
    q.dst_grouped_t = grouped.data(), q.group_rows = kGroupRows;
    ASSERT_TRUE(backend->QuantizeFp8(q).ok());
    EXPECT_EQ(scale[0], plain_scale[0]);
    EXPECT_EQ(scale[0], 75.0f / 448.0f);
    if (with_rows) EXPECT_EQ(dst, plain);
    int64_t row = 0, column = 0;
    for (int64_t group : kGroupRows) {
      EXPECT_EQ(column % 16, 0);
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t i = 0; i < Fp8PaddedRows(group); ++i) {
          const uint8_t want = i < group ? plain[(row + i) * cols + c] : 0;
          ASSERT_EQ(grouped[c * ld + column + i], want) << "group at row " << row << " c " << c;
        }
      }
      row += group;
      column += Fp8PaddedRows(group);
    }
  }
}

TEST(CpuFp8, GroupedTransposedEdgeCasesAndRefusals) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  const std::vector<uint16_t> src = GroupedSource(39, 24);
  alignas(16) float scale[4] = {0, 0, 0, 0};
  uint8_t sink[16] = {};
  // No rows at all (every local expert empty): nothing to write, the scale is 1.
  const std::vector<int64_t> empty = {0, 0, 0};
  QuantizeArgs q;
  q.src = src.data(), q.src_type = DType::kBFloat16, q.rows = 0, q.cols = 24;
  q.scale = scale, q.dst_grouped_t = sink, q.group_rows = empty;
  ASSERT_TRUE(backend->QuantizeFp8(q).ok());
  EXPECT_EQ(scale[0], 1.0f);
  EXPECT_EQ(Fp8GroupedColumns(empty), 0);
  // Groups that do not sum to rows, a negative group, batch > 1, transpose: refused.
  std::vector<uint8_t> grouped(24 * Fp8GroupedColumns(kGroupRows));
  q.rows = 39, q.dst_grouped_t = grouped.data(), q.group_rows = kGroupRows;
  ASSERT_TRUE(backend->QuantizeFp8(q).ok());
  q.rows = 38;
  EXPECT_FALSE(backend->QuantizeFp8(q).ok());
  const std::vector<int64_t> negative = {40, -1};
  q.rows = 39, q.group_rows = negative;
  EXPECT_FALSE(backend->QuantizeFp8(q).ok());
  q.group_rows = kGroupRows, q.transpose = true;
  EXPECT_FALSE(backend->QuantizeFp8(q).ok());
  q.transpose = false, q.batch = 2;
  EXPECT_FALSE(backend->QuantizeFp8(q).ok());
}

// FP8 amax from the producer: ActivationArgs::amax is max |a| / |d_h| as stored (NaN
// ignored), and QuantizeArgs::amax given it quantises as the amax pass would.
TEST(CpuFp8, ActivationAmaxFeedsTheQuantisation) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  const int64_t rows = 9, F = 12, up = 2 * F;
  std::mt19937_64 rng(7);
  std::vector<uint16_t> h(rows * up), d_a(rows * F), a(rows * F), d_h(rows * up);
  for (uint16_t& v : h) v = FloatToBf16(std::normal_distribution<float>(0.0f, 2.0f)(rng));
  for (uint16_t& v : d_a) v = FloatToBf16(std::normal_distribution<float>(0.0f, 1.0f)(rng));
  h[3] = FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  alignas(16) float amax[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  ActivationArgs args;
  args.rows = rows, args.ffn = F, args.dtype = DType::kBFloat16;
  args.h = h.data(), args.a = a.data(), args.d_a = d_a.data(), args.d_h = d_h.data();
  args.amax = amax;
  ASSERT_TRUE(backend->ActivationForward(args).ok());
  args.amax = amax + 4;
  ASSERT_TRUE(backend->ActivationBackward(args).ok());
  for (int which = 0; which < 2; ++which) {
    const std::vector<uint16_t>& out = which == 0 ? a : d_h;
    float want = 0;
    for (uint16_t v : out) want = std::fmax(want, std::fabs(Bf16ToFloat(v)));
    EXPECT_EQ(amax[which * 4], want);
    std::vector<uint8_t> codes(out.size()), given_codes(out.size());
    alignas(16) float scale[4], given_scale[4];
    QuantizeArgs q;
    q.src = out.data(), q.src_type = DType::kBFloat16, q.rows = rows;
    q.cols = static_cast<int64_t>(out.size()) / rows, q.dst = codes.data(), q.scale = scale;
    ASSERT_TRUE(backend->QuantizeFp8(q).ok());
    q.dst = given_codes.data(), q.scale = given_scale, q.amax = amax + which * 4;
    ASSERT_TRUE(backend->QuantizeFp8(q).ok());
    EXPECT_EQ(scale[0], given_scale[0]);
    EXPECT_EQ(codes, given_codes);
    q.batch = 2;  // a given amax is one matrix's
    EXPECT_FALSE(backend->QuantizeFp8(q).ok());
  }
}

// The weight-gradient GEMM the layer runs on grouped codes (moe_layer_experts.cc,
// ExpertWeightGradGemms): per group, C = scale_a scale_b sum over the group's rows of
// in[r, i] d_out[r, j] (the pads add nothing), written with beta 0 (empty groups: zeros) and
// accumulated with beta 1.
TEST(CpuFp8, WeightGradientGemmOnGroupedCodes) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  const int64_t rows = 39, in_cols = 24, out_cols = 16;
  const int64_t ld = Fp8GroupedColumns(kGroupRows), groups = kGroupRows.size();
  const std::vector<uint16_t> in = GroupedSource(rows, in_cols);
  std::vector<uint16_t> d_out(rows * out_cols);
  std::mt19937_64 rng(6);
  for (uint16_t& v : d_out) v = FloatToBf16(std::normal_distribution<float>(0.0f, 0.1f)(rng));
  std::vector<uint8_t> in_rows(rows * in_cols), in_t(in_cols * ld);
  std::vector<uint8_t> out_rows(rows * out_cols), out_t(out_cols * ld);
  alignas(16) float scales[8] = {};
  QuantizeArgs q;
  q.src_type = DType::kBFloat16, q.rows = rows, q.group_rows = kGroupRows;
  q.src = in.data(), q.cols = in_cols, q.dst = in_rows.data(), q.dst_grouped_t = in_t.data();
  q.scale = scales;
  ASSERT_TRUE(backend->QuantizeFp8(q).ok());
  q.src = d_out.data(), q.cols = out_cols, q.dst = out_rows.data(), q.dst_grouped_t = out_t.data();
  q.scale = scales + kFp8ScaleStride;
  ASSERT_TRUE(backend->QuantizeFp8(q).ok());
  std::vector<float> grad(groups * in_cols * out_cols, std::nanf(""));  // stale bytes
  for (float beta : {0.0f, 1.0f}) {
    std::vector<GemmArgs> gemms;
    int64_t column = 0;
    for (int64_t e = 0; e < groups; ++e) {
      GemmArgs g;
      g.trans_b = true;
      g.m = in_cols, g.n = out_cols, g.k = Fp8PaddedRows(kGroupRows[e]);
      g.a = in_t.data() + column, g.lda = ld, g.b = out_t.data() + column, g.ldb = ld;
      g.c = grad.data() + e * in_cols * out_cols, g.ldc = out_cols, g.beta = beta;
      g.a_fp8 = g.b_fp8 = kE4M3, g.a_scale = scales, g.b_scale = scales + kFp8ScaleStride;
      gemms.push_back(g);
      column += g.k;
    }
    ASSERT_TRUE(backend->GroupedGemm(gemms).ok());
    int64_t row = 0;
    for (int64_t e = 0; e < groups; ++e) {
      for (int64_t i = 0; i < in_cols; ++i) {
        for (int64_t j = 0; j < out_cols; ++j) {
          double want = 0, mag = 0;
          for (int64_t r = row; r < row + kGroupRows[e]; ++r) {
            const double t = static_cast<double>(Fp8ToFloat(in_rows[r * in_cols + i], kE4M3)) *
                             Fp8ToFloat(out_rows[r * out_cols + j], kE4M3) * scales[0] *
                             scales[kFp8ScaleStride];
            want += t;
            mag += std::fabs(t);
          }
          if (beta == 1.0f) want *= 2;  // the same gradient added to itself
          const float got = grad[(e * in_cols + i) * out_cols + j];
          if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(got));
          } else {
            EXPECT_NEAR(got, want, 1e-6 * mag + 1e-30) << "group " << e << " " << i << "," << j;
          }
        }
      }
      row += kGroupRows[e];
    }
  }
}

}  // namespace
}  // namespace moe
