// The tiny layer shape of the engine tests (H=32, F=64, E=8, k=2; everything else default).
//
//   LayerConfig c = TinyLayerConfig();
//   c.aux_loss_coeff = 1e-2;
#ifndef MOED_TESTS_ENGINE_TINY_CONFIG_H_
#define MOED_TESTS_ENGINE_TINY_CONFIG_H_

#include "engine/config.h"

namespace moe {

inline LayerConfig TinyLayerConfig() {
  LayerConfig c;
  c.hidden = 32;
  c.ffn = 64;
  c.num_experts = 8;
  c.top_k = 2;
  return c;
}

}  // namespace moe

#endif  // MOED_TESTS_ENGINE_TINY_CONFIG_H_
