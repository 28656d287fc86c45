#include "engine/init.h"

#include <cmath>
#include <cstring>

#include "gtest/gtest.h"

namespace moe {
namespace {

LayerConfig Tiny() {
  LayerConfig c;
  c.hidden = 32;
  c.ffn = 64;
  c.num_experts = 8;
  c.top_k = 2;
  c.init_seed = 1234;
  return c;
}

TEST(InitTest, Deterministic) {
  const LayerConfig c = Tiny();
  EXPECT_EQ(InitGate(c), InitGate(c));
  EXPECT_EQ(InitWi(c, 0, 8), InitWi(c, 0, 8));
  EXPECT_EQ(InitWo(c, 0, 8), InitWo(c, 0, 8));
}

TEST(InitTest, SeedChangesValues) {
  LayerConfig a = Tiny(), b = Tiny();
  b.init_seed = 1235;
  EXPECT_NE(InitGate(a), InitGate(b));
  EXPECT_NE(InitWi(a, 0, 1), InitWi(b, 0, 1));
}

// Rank 1 of 2 (experts 4..7) must initialise exactly the rows EP=1 has for those experts.
TEST(InitTest, IndependentOfEpRanks) {
  const LayerConfig c = Tiny();
  const int64_t up = UpWidth(c);
  const std::vector<float> all_wi = InitWi(c, 0, 8);
  const std::vector<float> rank1_wi = InitWi(c, 4, 4);
  ASSERT_EQ(rank1_wi.size(), static_cast<size_t>(4 * c.hidden * up));
  EXPECT_EQ(0, std::memcmp(rank1_wi.data(), all_wi.data() + 4 * c.hidden * up,
                           rank1_wi.size() * sizeof(float)));
  const std::vector<float> all_wo = InitWo(c, 0, 8);
  const std::vector<float> rank3_wo = InitWo(c, 6, 2);  // rank 3 of 4
  EXPECT_EQ(0, std::memcmp(rank3_wo.data(), all_wo.data() + 6 * c.ffn * c.hidden,
                           rank3_wo.size() * sizeof(float)));
}

TEST(InitTest, GatedAndPlainShareWi0) {
  LayerConfig gated = Tiny(), plain = Tiny();
  plain.gated = false;
  const std::vector<float> g = InitWi(gated, 2, 1), p = InitWi(plain, 2, 1);
  for (int64_t h = 0; h < gated.hidden; ++h) {
    for (int64_t f = 0; f < gated.ffn; ++f) {
      ASSERT_EQ(g[h * 2 * gated.ffn + f], p[h * gated.ffn + f]);
    }
  }
}

// Truncated at 2 sigma, sigma = 1/sqrt(fan_in); sample statistics of a large tensor.
TEST(InitTest, TruncatedNormalStatistics) {
  LayerConfig c = Tiny();
  c.hidden = 256;
  c.ffn = 128;
  const std::vector<float> wo = InitWo(c, 0, 8);  // fan_in F = 128
  const double sigma = 1.0 / std::sqrt(128.0);
  double sum = 0, sum_sq = 0, max_abs = 0;
  for (float v : wo) {
    sum += v;
    sum_sq += static_cast<double>(v) * v;
    max_abs = std::max(max_abs, std::fabs(static_cast<double>(v)));
  }
  const double n = static_cast<double>(wo.size());
  EXPECT_LE(max_abs, 2 * sigma + 1e-7);
  EXPECT_GT(max_abs, 1.9 * sigma);
  EXPECT_NEAR(sum / n, 0.0, 0.01 * sigma);
  // Variance of a normal truncated at +-2 sigma is 0.7737 sigma^2.
  EXPECT_NEAR(sum_sq / n / (sigma * sigma), 0.7737, 0.01);
}

}  // namespace
}  // namespace moe
