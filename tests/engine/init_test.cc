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

// docs/SPEC.md "Initialisation" written out literally: five splitmix64 rounds per uniform
// (InitRandomBits), attempts 2a and 2a + 1, Box-Muller, the first |z| <= 2. The fills hash in
// stages (engine/init.cc); every element must be this value, bit for bit, attempts beyond the
// first included.
// Attempt a's Box-Muller normal, before the truncation.
double LiteralNormal(uint64_t seed, uint64_t n, uint64_t expert, uint64_t index, uint64_t a) {
  auto uniform = [&](uint64_t counter) {
    return (static_cast<double>(InitRandomBits(seed, n, expert, index, counter) >> 11) + 0.5) *
           0x1.0p-53;
  };
  return std::sqrt(-2.0 * std::log(uniform(2 * a))) * std::cos(2.0 * M_PI * uniform(2 * a + 1));
}

float Literal(uint64_t seed, InitTensorId tensor, uint64_t expert, uint64_t index, double sigma) {
  for (uint64_t a = 0;; ++a) {
    const double z = LiteralNormal(seed, static_cast<uint64_t>(tensor), expert, index, a);
    if (std::fabs(z) <= 2.0) return static_cast<float>(z * sigma);
  }
}

TEST(InitTest, ValuesFollowTheDefinition) {
  LayerConfig c = Tiny();
  c.gated = true;
  const int64_t H = c.hidden, F = c.ffn, E = c.num_experts, first = 3, n = 4;
  const double sigma_h = 1.0 / std::sqrt(static_cast<double>(H)),
               sigma_f = 1.0 / std::sqrt(static_cast<double>(F));
  const std::vector<float> gate = InitGate(c), wi = InitWi(c, first, n), wo = InitWo(c, first, n);
  for (int64_t i = 0; i < H * E; ++i) {
    ASSERT_EQ(gate[i], Literal(c.init_seed, InitTensorId::kGate, 0, i, sigma_h)) << i;
  }
  int64_t second_attempts = 0;
  for (int64_t el = 0; el < n; ++el) {
    const uint64_t e = static_cast<uint64_t>(first + el);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t f = 0; f < F; ++f) {
        const uint64_t i = static_cast<uint64_t>(h * F + f);
        const float* row = wi.data() + (el * H + h) * 2 * F;
        ASSERT_EQ(row[f], Literal(c.init_seed, InitTensorId::kWi0, e, i, sigma_h));
        ASSERT_EQ(row[F + f], Literal(c.init_seed, InitTensorId::kWi1, e, i, sigma_h));
        const uint64_t o = static_cast<uint64_t>(f * H + h);
        ASSERT_EQ(wo[el * F * H + o], Literal(c.init_seed, InitTensorId::kWo, e, o, sigma_f));
        ASSERT_EQ(InitTruncatedNormal(c.init_seed, InitTensorId::kWo, e, o, sigma_f),
                  wo[el * F * H + o]);
        // An element whose first attempt is rejected (|z| > 2): the staged hash must reach
        // the same later attempts.
        const uint64_t wo_id = static_cast<uint64_t>(InitTensorId::kWo);
        second_attempts += std::fabs(LiteralNormal(c.init_seed, wo_id, e, o, 0)) > 2.0;
      }
    }
  }
  EXPECT_GT(second_attempts, 100);  // ~4.6 % of 8192 wo elements
}

// A fill large enough for ParallelRange's threads follows the definition too (sampled).
TEST(InitTest, ThreadedFillsFollowTheDefinition) {
  LayerConfig c = Tiny();
  c.hidden = 512;
  c.ffn = 1024;  // 512 K elements per expert: above ParallelRange's threshold
  const std::vector<float> wo = InitWo(c, 5, 2);
  const double sigma = 1.0 / std::sqrt(1024.0);
  for (size_t j = 0; j < wo.size(); j += 997) {
    const uint64_t e = 5 + j / (512 * 1024), i = j % (512 * 1024);
    ASSERT_EQ(wo[j], Literal(c.init_seed, InitTensorId::kWo, e, i, sigma)) << j;
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
