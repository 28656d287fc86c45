#include "proto/config_convert.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

}  // namespace

absl::StatusOr<LayerConfig> ConfigFromProto(const v1::LayerConfig& p) {
  LayerConfig c;
  c.hidden = p.hidden();
  c.ffn = p.ffn();
  c.num_experts = p.num_experts();
  c.top_k = p.has_top_k() ? p.top_k() : kDefaultTopK;
  switch (p.score_function()) {
    case v1::SCORE_FUNCTION_UNSPECIFIED:
    case v1::SCORE_FUNCTION_SOFTMAX:
      c.score_function = ScoreFunction::kSoftmax;
      break;
    case v1::SCORE_FUNCTION_SIGMOID:
      c.score_function = ScoreFunction::kSigmoid;
      break;
    default:
      return Invalid("config.score_function", absl::StrCat("unknown value ", p.score_function()));
  }
  c.pre_softmax = p.pre_softmax();
  c.num_groups = p.num_groups();
  c.group_topk = p.group_topk();
  c.scaling_factor = p.has_scaling_factor() ? p.scaling_factor() : kDefaultScalingFactor;
  c.use_expert_bias = p.use_expert_bias();
  c.aux_loss_coeff = p.aux_loss_coeff();
  c.z_loss_coeff = p.z_loss_coeff();
  c.capacity_factor = p.capacity_factor();
  c.align_size = p.align_size();
  switch (p.activation()) {
    case v1::ACTIVATION_UNSPECIFIED:
    case v1::ACTIVATION_SILU:
      c.activation = Activation::kSilu;
      break;
    case v1::ACTIVATION_GELU:
      c.activation = Activation::kGelu;
      break;
    case v1::ACTIVATION_RELU:
      c.activation = Activation::kRelu;
      break;
    case v1::ACTIVATION_LINEAR:
      c.activation = Activation::kLinear;
      break;
    default:
      return Invalid("config.activation", absl::StrCat("unknown value ", p.activation()));
  }
  c.gated = p.has_gated() ? p.gated() : kDefaultGated;
  c.use_bias = p.use_bias();
  if (p.compute_dtype().empty()) {
    c.compute_dtype = kDefaultComputeDType;
  } else {
    absl::StatusOr<DType> dtype = ParseComputeDType(p.compute_dtype());
    if (!dtype.ok()) {
      return Invalid("config.compute_dtype",
                     absl::StrCat("\"", p.compute_dtype(), "\" is not FP32, BF16 or FP8"));
    }
    c.compute_dtype = *dtype;
  }
  c.init_seed = p.init_seed();
  if (!p.fp8_recipe().empty()) {
    absl::StatusOr<Fp8Recipe> recipe = ParseFp8Recipe(p.fp8_recipe());
    if (!recipe.ok()) {
      return Invalid("config.fp8_recipe",
                     absl::StrCat("\"", p.fp8_recipe(), "\" is not DELAYED or CURRENT"));
    }
    c.fp8_recipe = *recipe;
  }
  if (p.has_fp8_amax_history_len()) c.fp8_amax_history_len = p.fp8_amax_history_len();
  c.fp8_margin = p.fp8_margin();
  if (!p.fp8_amax_compute_algo().empty()) {
    absl::StatusOr<Fp8AmaxAlgo> algo = ParseFp8AmaxAlgo(p.fp8_amax_compute_algo());
    if (!algo.ok()) {
      return Invalid("config.fp8_amax_compute_algo",
                     absl::StrCat("\"", p.fp8_amax_compute_algo(), "\" is not max or most_recent"));
    }
    c.fp8_amax_compute_algo = *algo;
  }
  if (!p.fp8_gemms().empty()) {
    absl::StatusOr<Fp8GemmsPolicy> gemms = ParseFp8GemmsPolicy(p.fp8_gemms());
    if (!gemms.ok()) {
      return Invalid("config.fp8_gemms",
                     absl::StrCat("\"", p.fp8_gemms(),
                                  "\" is not AUTO, ALL, none or a set of fc1_fprop, fc1_dgrad, "
                                  "fc1_wgrad, fc2_fprop, fc2_dgrad, fc2_wgrad"));
    }
    c.fp8_gemms = *gemms;
  }
  return c;
}

v1::LayerConfig ConfigToProto(const LayerConfig& c) {
  v1::LayerConfig p;
  p.set_hidden(c.hidden);
  p.set_ffn(c.ffn);
  p.set_num_experts(c.num_experts);
  p.set_top_k(c.top_k);
  p.set_score_function(c.score_function == ScoreFunction::kSigmoid ? v1::SCORE_FUNCTION_SIGMOID
                                                                   : v1::SCORE_FUNCTION_SOFTMAX);
  p.set_pre_softmax(c.pre_softmax);
  p.set_num_groups(c.num_groups);
  p.set_group_topk(c.group_topk);
  p.set_scaling_factor(c.scaling_factor);
  p.set_use_expert_bias(c.use_expert_bias);
  p.set_aux_loss_coeff(c.aux_loss_coeff);
  p.set_z_loss_coeff(c.z_loss_coeff);
  p.set_capacity_factor(c.capacity_factor);
  p.set_align_size(c.align_size);
  switch (c.activation) {
    case Activation::kSilu:
      p.set_activation(v1::ACTIVATION_SILU);
      break;
    case Activation::kGelu:
      p.set_activation(v1::ACTIVATION_GELU);
      break;
    case Activation::kRelu:
      p.set_activation(v1::ACTIVATION_RELU);
      break;
    case Activation::kLinear:
      p.set_activation(v1::ACTIVATION_LINEAR);
      break;
  }
  p.set_gated(c.gated);
  p.set_use_bias(c.use_bias);
  p.set_compute_dtype(ComputeDTypeName(c.compute_dtype));
  p.set_init_seed(c.init_seed);
  p.set_fp8_recipe(Fp8RecipeName(c.fp8_recipe));
  p.set_fp8_amax_history_len(c.fp8_amax_history_len);
  p.set_fp8_margin(c.fp8_margin);
  p.set_fp8_amax_compute_algo(Fp8AmaxAlgoName(c.fp8_amax_compute_algo));
  p.set_fp8_gemms(Fp8GemmsPolicyName(c.fp8_gemms));
  return p;
}

absl::StatusOr<OptimizerConfig> OptimizerFromProto(const v1::SgdOptimizer* sgd,
                                                   const v1::AdamWOptimizer* adamw) {
  OptimizerConfig o;
  auto finite = [](double v) { return std::isfinite(v); };
  if (sgd != nullptr) {
    o = OptimizerConfig::Sgd(sgd->lr(), sgd->momentum(), sgd->weight_decay());
    if (!finite(sgd->lr()) || sgd->lr() <= 0) return Invalid("sgd.lr", "must be > 0");
    if (!finite(sgd->momentum()) || sgd->momentum() < 0 || sgd->momentum() >= 1) {
      return Invalid("sgd.momentum", "must be in [0, 1)");
    }
    if (!finite(sgd->weight_decay()) || sgd->weight_decay() < 0) {
      return Invalid("sgd.weight_decay", "must be >= 0");
    }
    return o;
  }
  if (adamw != nullptr) {
    o = OptimizerConfig::AdamW(adamw->lr(), adamw->weight_decay());
    if (adamw->has_beta1()) o.beta1 = adamw->beta1();
    if (adamw->has_beta2()) o.beta2 = adamw->beta2();
    if (adamw->has_eps()) o.eps = adamw->eps();
    if (!finite(o.lr) || o.lr <= 0) return Invalid("adamw.lr", "must be > 0");
    if (!finite(o.beta1) || o.beta1 < 0 || o.beta1 >= 1) {
      return Invalid("adamw.beta1", "must be in [0, 1)");
    }
    if (!finite(o.beta2) || o.beta2 < 0 || o.beta2 >= 1) {
      return Invalid("adamw.beta2", "must be in [0, 1)");
    }
    if (!finite(o.eps) || o.eps <= 0) return Invalid("adamw.eps", "must be > 0");
    if (!finite(o.weight_decay) || o.weight_decay < 0) {
      return Invalid("adamw.weight_decay", "must be >= 0");
    }
    return o;
  }
  return Invalid("optimizer", "set exactly one of sgd, adamw");
}

}  // namespace moe
