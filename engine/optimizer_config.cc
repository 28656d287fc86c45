// OptimizerConfig's factories (engine/moe_layer.h), in a file of their own: the config fuzzer
// (tests/fuzz) compiles them without the rest of the layer (backend, init, kernels).
#include "engine/moe_layer.h"

namespace moe {

OptimizerConfig OptimizerConfig::Sgd(double lr, double momentum, double weight_decay) {
  OptimizerConfig o;
  o.kind = Kind::kSgd;
  o.lr = lr;
  o.momentum = momentum;
  o.weight_decay = weight_decay;
  return o;
}

OptimizerConfig OptimizerConfig::AdamW(double lr, double weight_decay) {
  OptimizerConfig o;
  o.kind = Kind::kAdamW;
  o.lr = lr;
  o.weight_decay = weight_decay;
  return o;
}

}  // namespace moe
