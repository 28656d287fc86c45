#include "client/config_convert.h"

#include "absl/strings/str_cat.h"

namespace moe {
namespace client {

absl::StatusOr<LayerConfig> EngineConfigFromProto(const v1::LayerConfig& proto) {
  LayerConfig config;
  config.hidden = proto.hidden();
  config.ffn = proto.ffn();
  config.num_experts = proto.num_experts();
  config.top_k = proto.has_top_k() ? proto.top_k() : 1;
  switch (proto.score_function()) {
    case v1::SCORE_FUNCTION_UNSPECIFIED:
    case v1::SCORE_FUNCTION_SOFTMAX:
      config.score_function = ScoreFunction::kSoftmax;
      break;
    case v1::SCORE_FUNCTION_SIGMOID:
      config.score_function = ScoreFunction::kSigmoid;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("config.score_function: unknown value ", proto.score_function()));
  }
  config.pre_softmax = proto.pre_softmax();
  config.num_groups = proto.num_groups();
  config.group_topk = proto.group_topk();
  config.scaling_factor = proto.has_scaling_factor() ? proto.scaling_factor() : 1.0;
  config.use_expert_bias = proto.use_expert_bias();
  config.aux_loss_coeff = proto.aux_loss_coeff();
  config.z_loss_coeff = proto.z_loss_coeff();
  config.capacity_factor = proto.capacity_factor();
  config.align_size = proto.align_size();
  switch (proto.activation()) {
    case v1::ACTIVATION_UNSPECIFIED:
    case v1::ACTIVATION_SILU:
      config.activation = Activation::kSilu;
      break;
    case v1::ACTIVATION_GELU:
      config.activation = Activation::kGelu;
      break;
    case v1::ACTIVATION_RELU:
      config.activation = Activation::kRelu;
      break;
    case v1::ACTIVATION_LINEAR:
      config.activation = Activation::kLinear;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("config.activation: unknown value ", proto.activation()));
  }
  config.gated = proto.has_gated() ? proto.gated() : true;
  config.use_bias = proto.use_bias();
  if (proto.compute_dtype().empty() || proto.compute_dtype() == "FP32") {
    config.compute_dtype = DType::kFloat32;
  } else if (proto.compute_dtype() == "BF16") {
    config.compute_dtype = DType::kBFloat16;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("config.compute_dtype: '", proto.compute_dtype(), "' is not FP32 or BF16"));
  }
  config.init_seed = proto.init_seed();
  return config;
}

v1::LayerConfig ProtoFromEngineConfig(const LayerConfig& config) {
  v1::LayerConfig proto;
  proto.set_hidden(config.hidden);
  proto.set_ffn(config.ffn);
  proto.set_num_experts(config.num_experts);
  proto.set_top_k(config.top_k);
  proto.set_score_function(config.score_function == ScoreFunction::kSigmoid
                               ? v1::SCORE_FUNCTION_SIGMOID
                               : v1::SCORE_FUNCTION_SOFTMAX);
  proto.set_pre_softmax(config.pre_softmax);
  proto.set_num_groups(config.num_groups);
  proto.set_group_topk(config.group_topk);
  proto.set_scaling_factor(config.scaling_factor);
  proto.set_use_expert_bias(config.use_expert_bias);
  proto.set_aux_loss_coeff(config.aux_loss_coeff);
  proto.set_z_loss_coeff(config.z_loss_coeff);
  proto.set_capacity_factor(config.capacity_factor);
  proto.set_align_size(config.align_size);
  switch (config.activation) {
    case Activation::kSilu:
      proto.set_activation(v1::ACTIVATION_SILU);
      break;
    case Activation::kGelu:
      proto.set_activation(v1::ACTIVATION_GELU);
      break;
    case Activation::kRelu:
      proto.set_activation(v1::ACTIVATION_RELU);
      break;
    case Activation::kLinear:
      proto.set_activation(v1::ACTIVATION_LINEAR);
      break;
  }
  proto.set_gated(config.gated);
  proto.set_use_bias(config.use_bias);
  proto.set_compute_dtype(DTypeName(config.compute_dtype));
  proto.set_init_seed(config.init_seed);
  return proto;
}

}  // namespace client
}  // namespace moe
