// The two OptimizerConfig factories proto/config_convert.cc calls, as engine/moe_layer_params.cc
// defines them: that file would bring the whole layer (backend, init, kernels) into the
// config fuzzer, which never builds a layer. Keep in step with engine/moe_layer_params.cc.
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
