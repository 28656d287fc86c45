#include "engine/init.h"

#include <cmath>

namespace moe {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1): the top 53 bits, shifted by half a step so 0 never appears.
double ToUnitOpen(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }

}  // namespace

uint64_t InitRandomBits(uint64_t seed, uint64_t tensor, uint64_t expert, uint64_t index,
                        uint64_t attempt) {
  uint64_t h = SplitMix64(seed);
  h = SplitMix64(h ^ tensor);
  h = SplitMix64(h ^ (expert * 0x632be59bd9b4e019ull));
  h = SplitMix64(h ^ index);
  return SplitMix64(h ^ (attempt * 0xd1b54a32d192ed03ull));
}

float InitTruncatedNormal(uint64_t seed, InitTensorId tensor, uint64_t expert, uint64_t index,
                          double sigma) {
  const uint64_t n = static_cast<uint64_t>(tensor);
  // Each attempt draws two uniforms from its own counters; P(|z| > 2) ~ 4.6%, so the loop
  // ends after ~1.05 attempts on average, and always at the same attempt for an element.
  for (uint64_t attempt = 0;; ++attempt) {
    const double u1 = ToUnitOpen(InitRandomBits(seed, n, expert, index, 2 * attempt));
    const double u2 = ToUnitOpen(InitRandomBits(seed, n, expert, index, 2 * attempt + 1));
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    if (std::fabs(z) <= 2.0) return static_cast<float>(z * sigma);
  }
}

std::vector<float> InitGate(const LayerConfig& c) {
  std::vector<float> out(static_cast<size_t>(c.hidden * c.num_experts));
  const double sigma = 1.0 / std::sqrt(static_cast<double>(c.hidden));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = InitTruncatedNormal(c.init_seed, InitTensorId::kGate, 0, i, sigma);
  }
  return out;
}

std::vector<float> InitWi(const LayerConfig& c, int64_t first_expert, int64_t experts) {
  const int64_t up = UpWidth(c);
  std::vector<float> out(static_cast<size_t>(experts * c.hidden * up));
  const double sigma = 1.0 / std::sqrt(static_cast<double>(c.hidden));
  for (int64_t el = 0; el < experts; ++el) {
    const uint64_t e = static_cast<uint64_t>(first_expert + el);
    float* w = out.data() + el * c.hidden * up;
    for (int64_t h = 0; h < c.hidden; ++h) {
      for (int64_t f = 0; f < c.ffn; ++f) {
        const uint64_t i = static_cast<uint64_t>(h * c.ffn + f);
        w[h * up + f] = InitTruncatedNormal(c.init_seed, InitTensorId::kWi0, e, i, sigma);
        if (c.gated) {
          w[h * up + c.ffn + f] =
              InitTruncatedNormal(c.init_seed, InitTensorId::kWi1, e, i, sigma);
        }
      }
    }
  }
  return out;
}

std::vector<float> InitWo(const LayerConfig& c, int64_t first_expert, int64_t experts) {
  const int64_t per_expert = c.ffn * c.hidden;
  std::vector<float> out(static_cast<size_t>(experts * per_expert));
  const double sigma = 1.0 / std::sqrt(static_cast<double>(c.ffn));
  for (int64_t el = 0; el < experts; ++el) {
    const uint64_t e = static_cast<uint64_t>(first_expert + el);
    for (int64_t i = 0; i < per_expert; ++i) {
      out[el * per_expert + i] =
          InitTruncatedNormal(c.init_seed, InitTensorId::kWo, e, static_cast<uint64_t>(i), sigma);
    }
  }
  return out;
}

}  // namespace moe
