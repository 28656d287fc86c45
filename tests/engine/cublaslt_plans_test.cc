// engine/cuda/cublaslt_plans.h on the host: which GEMM shapes take a tuned configuration (the
// nearest probed rows within kTunedRowsReach, every other dim and flag equal) and on which
// devices the table applies. That a tuned plan changes no result is checked on the GPU
// (tests/gpu/cuda_backend_ops_test.cc, TunedGemmPlansKeepResults).
#include "engine/cuda/cublaslt_plans.h"

#include "gtest/gtest.h"

namespace moe {
namespace cuda {
namespace {

// qwen3's up GEMM h = X wi (H 2048, up 1536) with m rows.
TunedGemmShape QwenUp(int64_t m) { return {false, false, false, false, m, 1536, 2048}; }
// qwen3's d_wo = a^T d_y (F 768, H 2048) over k rows, written or accumulated.
TunedGemmShape QwenWgradWo(int64_t k, bool accumulate) {
  return {true, false, true, accumulate, 768, 2048, k};
}

TEST(TunedGemms, DimsBucketByThirtyTwoThenFourStepsPerOctave) {
  EXPECT_EQ(GemmDimBucket(1), 32);
  EXPECT_EQ(GemmDimBucket(32), 32);
  EXPECT_EQ(GemmDimBucket(33), 64);
  EXPECT_EQ(GemmDimBucket(256), 256);
  EXPECT_EQ(GemmDimBucket(257), 320);  // octave 256..512 in steps of 64
  EXPECT_EQ(GemmDimBucket(320), 320);
  EXPECT_EQ(GemmDimBucket(513), 640);  // 512..1024 in steps of 128
  EXPECT_EQ(GemmDimBucket(896), 896);
  EXPECT_EQ(GemmDimBucket(1025), 1280);
  EXPECT_EQ(GemmDimBucket(7168), 7168);
}

TEST(TunedGemms, ProbedShapeTakesItsConfiguration) {
  std::optional<TunedGemmConfig> c = FindTunedGemm(QwenUp(1024));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->algo, 66);
  EXPECT_EQ(c->tile, 21);
  EXPECT_EQ(c->swizzle, 1);
  EXPECT_EQ(c->cluster, 2);
}

TEST(TunedGemms, RowsTakeTheNearestProbedCountWithinReach) {
  // Probed at 896 (tile 20), 1024 (tile 21) and 1280 (tile 20, no swizzle).
  EXPECT_EQ(FindTunedGemm(QwenUp(768))->tile, 20);        // 896 / 768 = 1.17
  EXPECT_EQ(FindTunedGemm(QwenUp(1100))->tile, 21);       // nearer 1024 than 1280
  EXPECT_EQ(FindTunedGemm(QwenUp(1152))->swizzle, 0);     // 1280 / 1152 < 1152 / 1024
  EXPECT_TRUE(FindTunedGemm(QwenUp(1920)).has_value());   // 1920 / 1280 = 1.5: the reach
  EXPECT_FALSE(FindTunedGemm(QwenUp(2048)).has_value());  // 1.6: beyond
  EXPECT_FALSE(FindTunedGemm(QwenUp(512)).has_value());   // 896 / 512 = 1.75
  EXPECT_FALSE(FindTunedGemm(QwenUp(0)).has_value());
}

TEST(TunedGemms, ReachIncludesItsBoundEitherWay) {
  EXPECT_TRUE(WithinTunedReach(1024, 1024));
  EXPECT_TRUE(WithinTunedReach(1280, 1920));  // 1.5: the reach itself
  EXPECT_TRUE(WithinTunedReach(8192, 12288));
  EXPECT_TRUE(WithinTunedReach(12288, 8192));
  EXPECT_FALSE(WithinTunedReach(1280, 2048));  // 1.6
  EXPECT_FALSE(WithinTunedReach(896, 512));    // 1.75 the other way
}

TEST(TunedGemms, OtherDimsAndFlagsMustBeEqual) {
  TunedGemmShape s = QwenUp(1024);
  s.n = 1537;
  EXPECT_FALSE(FindTunedGemm(s).has_value());
  s = QwenUp(1024);
  s.k = 1024;
  EXPECT_FALSE(FindTunedGemm(s).has_value());
  s = QwenUp(1024);
  s.trans_b = true;  // d_a's transpose with up's dims: not probed
  EXPECT_FALSE(FindTunedGemm(s).has_value());
  s = QwenUp(1024);
  s.fp32_c = true;
  EXPECT_FALSE(FindTunedGemm(s).has_value());
  s = QwenUp(1024);
  s.accumulate = true;
  EXPECT_FALSE(FindTunedGemm(s).has_value());
}

TEST(TunedGemms, WeightGradientRowsAreK) {
  // Written and accumulated d_wo have their own configurations (swizzle and cluster differ).
  ASSERT_TRUE(FindTunedGemm(QwenWgradWo(1024, false)).has_value());
  ASSERT_TRUE(FindTunedGemm(QwenWgradWo(896, true)).has_value());
  EXPECT_EQ(FindTunedGemm(QwenWgradWo(1024, false))->cluster, 3);
  EXPECT_EQ(FindTunedGemm(QwenWgradWo(896, true))->cluster, 5);
  EXPECT_FALSE(FindTunedGemm(QwenWgradWo(512, false)).has_value());  // 2x fewer rows
  TunedGemmShape other_m = QwenWgradWo(1024, false);
  other_m.m = 1024;
  EXPECT_FALSE(FindTunedGemm(other_m).has_value());
  // Shapes the probe found nothing for are not listed: dsv3's d_X, te_seed's written d_wi.
  EXPECT_FALSE(FindTunedGemm({false, true, false, false, 256, 7168, 4096}).has_value());
  EXPECT_FALSE(FindTunedGemm({true, false, true, false, 1024, 8192, 8192}).has_value());
  // dsv3's d_a (probed with routed rows at 256) serves its buckets 224 and 320; te_seed's up
  // GEMM (probed likewise at 8192 rows) its bucket 10240.
  for (const TunedGemmShape& s : {TunedGemmShape{false, true, false, false, 224, 2048, 7168},
                                  TunedGemmShape{false, true, false, false, 320, 2048, 7168}}) {
    ASSERT_TRUE(FindTunedGemm(s).has_value()) << s.m;
    EXPECT_EQ(FindTunedGemm(s)->tile, 21);
  }
  const std::optional<TunedGemmConfig> te_up =
      FindTunedGemm({false, false, false, false, 10240, 8192, 1024});
  ASSERT_TRUE(te_up.has_value());
  EXPECT_EQ(te_up->tile, 29);
  EXPECT_EQ(te_up->custom, 1);  // the heuristic candidate's custom option travels with it
  // dsv3's weight gradients: d_wo written only, d_wi written and accumulated, each its own.
  const TunedGemmShape dsv3_wo{true, false, true, false, 2048, 7168, 288};
  ASSERT_TRUE(FindTunedGemm(dsv3_wo).has_value());
  EXPECT_EQ(FindTunedGemm(dsv3_wo)->custom, 3);
  EXPECT_FALSE(FindTunedGemm({true, false, true, true, 2048, 7168, 288}).has_value());
  ASSERT_TRUE(FindTunedGemm({true, false, true, true, 7168, 4096, 224}).has_value());
  EXPECT_EQ(FindTunedGemm({true, false, true, true, 7168, 4096, 224})->tile, 248);
  EXPECT_EQ(FindTunedGemm({true, false, true, false, 7168, 4096, 224})->custom, 4);
  // Its deferred weight gradients (k around 768) have entries of their own, written and
  // accumulated, which also serve 512..1152 rows but not the single backward's 256.
  EXPECT_EQ(FindTunedGemm({true, false, true, true, 2048, 7168, 768})->tile, 24);
  EXPECT_EQ(FindTunedGemm({true, false, true, false, 2048, 7168, 1100})->tile, 20);
  EXPECT_EQ(FindTunedGemm({true, false, true, false, 2048, 7168, 1100})->custom, 3);
  EXPECT_EQ(FindTunedGemm({true, false, true, true, 7168, 4096, 600})->custom, 6);
  EXPECT_EQ(FindTunedGemm({true, false, true, false, 7168, 4096, 900})->tile, 29);
  EXPECT_FALSE(FindTunedGemm({true, false, true, true, 2048, 7168, 256}).has_value());
  EXPECT_FALSE(FindTunedGemm({true, false, true, true, 7168, 4096, 1300}).has_value());
}

TEST(TunedGemms, ApplyOnlyWhereMeasured) {
  EXPECT_TRUE(TunedGemmsApply(9, 0, 132, 130100));  // H200 / H100 SXM, cuBLASLt 13.1
  EXPECT_TRUE(TunedGemmsApply(9, 0, 132, 139999));
  EXPECT_FALSE(TunedGemmsApply(9, 0, 114, 130100));  // H100 PCIe: other SM count
  EXPECT_FALSE(TunedGemmsApply(8, 0, 108, 130100));  // A100
  EXPECT_FALSE(TunedGemmsApply(10, 0, 148, 130100));
  EXPECT_FALSE(TunedGemmsApply(9, 0, 132, 120900));  // another cuBLASLt
  EXPECT_FALSE(TunedGemmsApply(9, 0, 132, 140000));
}

}  // namespace
}  // namespace cuda
}  // namespace moe
