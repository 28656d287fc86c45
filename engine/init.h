// Deterministic, EP-independent parameter initialisation (docs/SPEC.md "Initialisation").
//
// Element i of tensor n for expert e is a pure function of (seed, n, e, i): a counter-based
// generator (splitmix64 hashing of the 4-tuple) feeds a Box-Muller normal, rejected outside
// +-2 sigma with a deterministic per-element attempt counter. A rank that initialises only its
// own experts therefore gets exactly the values EP=1 has for them.
//
// Tensor ids (InitTensorId) and element indices:
//   gate  n=0, e=0 (the router has no expert index), i = h * E + e'   over [H, E], sigma 1/sqrt(H)
//   wi_0  n=1, e = global expert, i = h * F + f  over that expert's [H, F], sigma 1/sqrt(H)
//   wi_1  n=2, e = global expert, i = h * F + f  over that expert's [H, F], sigma 1/sqrt(H)
//   wo    n=3, e = global expert, i = f * H + h  over that expert's [F, H], sigma 1/sqrt(F)
// wi_0 and wi_1 have their own ids, so wi_0 is the same whether the layer is gated or not.
// Biases and expert_bias are zero.
//
//   std::vector<float> wi = InitWi(config, /*first_expert=*/4, /*experts=*/4);  // [4, H, up]
#ifndef MOED_ENGINE_INIT_H_
#define MOED_ENGINE_INIT_H_

#include <cstdint>
#include <vector>

#include "engine/config.h"

namespace moe {

enum class InitTensorId : uint64_t { kGate = 0, kWi0 = 1, kWi1 = 2, kWo = 3 };

// 64 random bits of counter (seed, tensor, expert, index, attempt).
uint64_t InitRandomBits(uint64_t seed, uint64_t tensor, uint64_t expert, uint64_t index,
                        uint64_t attempt);
// One truncated-normal (+-2 sigma) draw for element (seed, tensor, expert, index).
float InitTruncatedNormal(uint64_t seed, InitTensorId tensor, uint64_t expert, uint64_t index,
                          double sigma);

// Whole tensors, row-major, for global experts [first_expert, first_expert + experts).
std::vector<float> InitGate(const LayerConfig& config);                                 // [H, E]
std::vector<float> InitWi(const LayerConfig& config, int64_t first_expert, int64_t experts);  // [n, H, up]
std::vector<float> InitWo(const LayerConfig& config, int64_t first_expert, int64_t experts);  // [n, F, H]

}  // namespace moe

#endif  // MOED_ENGINE_INIT_H_
