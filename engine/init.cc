#include "engine/init.h"

#include <algorithm>
#include <cmath>
#include <thread>

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

constexpr uint64_t kExpertMul = 0x632be59bd9b4e019ull, kAttemptMul = 0xd1b54a32d192ed03ull;

// InitRandomBits in stages: the hash of (seed, tensor, expert) is the same for a whole expert's
// tensor, and that of (..., index) for every attempt of one element, so the fills below hash
// 3 times per element instead of 10, with the same bits (InitTest.ValuesFollowTheDefinition).
uint64_t TensorKey(uint64_t seed, uint64_t tensor, uint64_t expert) {
  return SplitMix64(SplitMix64(SplitMix64(seed) ^ tensor) ^ (expert * kExpertMul));
}
uint64_t ElementKey(uint64_t tensor_key, uint64_t index) { return SplitMix64(tensor_key ^ index); }
uint64_t AttemptBits(uint64_t element_key, uint64_t attempt) {
  return SplitMix64(element_key ^ (attempt * kAttemptMul));
}

// Each attempt draws two uniforms from its own counters; P(|z| > 2) ~ 4.6%, so the loop ends
// after ~1.05 attempts on average, and always at the same attempt for an element.
float TruncatedNormal(uint64_t element_key, double sigma) {
  for (uint64_t attempt = 0;; ++attempt) {
    const double u1 = ToUnitOpen(AttemptBits(element_key, 2 * attempt));
    const double u2 = ToUnitOpen(AttemptBits(element_key, 2 * attempt + 1));
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    if (std::fabs(z) <= 2.0) return static_cast<float>(z * sigma);
  }
}

}  // namespace

uint64_t InitRandomBits(uint64_t seed, uint64_t tensor, uint64_t expert, uint64_t index,
                        uint64_t attempt) {
  uint64_t h = SplitMix64(seed);
  h = SplitMix64(h ^ tensor);
  h = SplitMix64(h ^ (expert * kExpertMul));
  h = SplitMix64(h ^ index);
  return SplitMix64(h ^ (attempt * kAttemptMul));
}

float InitTruncatedNormal(uint64_t seed, InitTensorId tensor, uint64_t expert, uint64_t index,
                          double sigma) {
  return TruncatedNormal(ElementKey(TensorKey(seed, static_cast<uint64_t>(tensor), expert), index),
                         sigma);
}

namespace {

// Runs fn(begin, end) over [0, n) on up to hardware_concurrency threads: values are pure
// functions of their indices, so the split does not change them. Large layers (dsv3: 11G
// elements) would otherwise take minutes to initialise on one core.
template <typename Fn>
void ParallelRange(int64_t n, int64_t elements_per_item, const Fn& fn) {
  const int64_t total = n * elements_per_item;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  // Layer creation calls this per group of experts of ~1M elements (so that a cancelled
  // CreateLayer stops within a group): the threshold stays below that, or creation would run on
  // one core (measured: 40 s instead of a few for 128 experts of 2048 x 768 on 16 cores).
  if (threads <= 1 || total < (int64_t{1} << 18) || n < 2) {
    fn(0, n);
    return;
  }
  threads = static_cast<int>(std::min<int64_t>(threads, n));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
    pool.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  for (std::thread& th : pool) th.join();
}

uint64_t Id(InitTensorId tensor) { return static_cast<uint64_t>(tensor); }

}  // namespace

std::vector<float> InitGate(const LayerConfig& c) {
  std::vector<float> out(static_cast<size_t>(c.hidden * c.num_experts));
  const double sigma = 1.0 / std::sqrt(static_cast<double>(c.hidden));
  const uint64_t key = TensorKey(c.init_seed, Id(InitTensorId::kGate), 0);
  for (size_t i = 0; i < out.size(); ++i) out[i] = TruncatedNormal(ElementKey(key, i), sigma);
  return out;
}

std::vector<float> InitWi(const LayerConfig& c, int64_t first_expert, int64_t experts) {
  const int64_t up = UpWidth(c);
  std::vector<float> out(static_cast<size_t>(experts * c.hidden * up));
  const double sigma = 1.0 / std::sqrt(static_cast<double>(c.hidden));
  // Items are rows (expert el, hidden h) of the [experts * H, up] result.
  ParallelRange(experts * c.hidden, up, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t el = row / c.hidden, h = row % c.hidden;
      const uint64_t e = static_cast<uint64_t>(first_expert + el);
      const uint64_t key0 = TensorKey(c.init_seed, Id(InitTensorId::kWi0), e),
                     key1 = TensorKey(c.init_seed, Id(InitTensorId::kWi1), e);
      float* w = out.data() + row * up;
      for (int64_t f = 0; f < c.ffn; ++f) {
        const uint64_t i = static_cast<uint64_t>(h * c.ffn + f);
        w[f] = TruncatedNormal(ElementKey(key0, i), sigma);
        if (c.gated) w[c.ffn + f] = TruncatedNormal(ElementKey(key1, i), sigma);
      }
    }
  });
  return out;
}

std::vector<float> InitWo(const LayerConfig& c, int64_t first_expert, int64_t experts) {
  const int64_t per_expert = c.ffn * c.hidden;
  std::vector<float> out(static_cast<size_t>(experts * per_expert));
  const double sigma = 1.0 / std::sqrt(static_cast<double>(c.ffn));
  // Items are rows (expert el, f) of the [experts * F, H] result.
  ParallelRange(experts * c.ffn, c.hidden, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t el = row / c.ffn, f = row % c.ffn;
      const uint64_t key =
          TensorKey(c.init_seed, Id(InitTensorId::kWo), static_cast<uint64_t>(first_expert + el));
      float* w = out.data() + el * per_expert;
      for (int64_t h = 0; h < c.hidden; ++h) {
        const uint64_t i = static_cast<uint64_t>(f * c.hidden + h);
        w[i] = TruncatedNormal(ElementKey(key, i), sigma);
      }
    }
  });
  return out;
}

}  // namespace moe
