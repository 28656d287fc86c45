#include "client/layer_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "engine/dtype.h"
#include "engine/fp8_gemms.h"
#include "proto/config_convert.h"

ABSL_FLAG(int64_t, hidden, 32, "Layer: H, the model width (last dimension of x).");
ABSL_FLAG(int64_t, ffn, 64, "Layer: F, each expert's FFN width.");
ABSL_FLAG(int64_t, experts, 8, "Layer: E, number of experts (a multiple of the workers).");
ABSL_FLAG(int64_t, top_k, 2, "Layer: k, experts per token.");
ABSL_FLAG(std::string, score_function, "softmax", "Layer: router scores, softmax|sigmoid.");
ABSL_FLAG(bool, pre_softmax, false, "Layer: softmax only, select on softmax(z) instead of z.");
ABSL_FLAG(int64_t, num_groups, 0, "Layer: grouped top-k, number of expert groups (0 = off).");
ABSL_FLAG(int64_t, group_topk, 0, "Layer: grouped top-k, groups kept per token (0 = off).");
ABSL_FLAG(double, scaling_factor, 1.0, "Layer: multiplies the routing weights.");
ABSL_FLAG(bool, expert_bias, false,
          "Layer: sigmoid only, selection-only expert bias (aux-loss-free balancing).");
ABSL_FLAG(double, aux_loss_coeff, 0.0, "Layer: load-balancing aux loss coefficient (0 = off).");
ABSL_FLAG(double, z_loss_coeff, 0.0, "Layer: router z-loss coefficient (0 = off).");
ABSL_FLAG(double, capacity_factor, 0.0, "Layer: expert capacity factor (0 = dropless).");
ABSL_FLAG(int64_t, align_size, 0, "Layer: pad each expert's rows to a multiple (0 = off).");
ABSL_FLAG(std::string, activation, "silu", "Layer: silu|gelu|relu|linear.");
ABSL_FLAG(bool, gated, true, "Layer: gated FFN (SwiGLU-style wi = [wi_0 | wi_1]).");
ABSL_FLAG(bool, use_bias, false, "Layer: bias terms wi_bias and wo_bias.");
ABSL_FLAG(std::string, compute_dtype, "fp32",
          "Layer: expert GEMM datatype, fp32|bf16|fp8 (fp8: e4m3 GEMMs, docs/SPEC.md).");
ABSL_FLAG(std::string, fp8_recipe, "",
          "Layer, fp8 only: delayed|current scaling of the activations and gradients "
          "(docs/SPEC.md \"FP8\"); empty = the server's default (delayed).");
ABSL_FLAG(std::string, fp8_gemms, "",
          "Layer, fp8 only: which expert GEMMs quantise: AUTO (FP8 where measured faster), "
          "ALL, none, or a set of fc1_fprop,fc1_dgrad,fc1_wgrad,fc2_fprop,fc2_dgrad,fc2_wgrad "
          "(docs/SPEC.md \"Per-GEMM choice\"); empty = the server's default (AUTO).");
ABSL_FLAG(uint64_t, seed, 0, "Layer: seed of the deterministic weight initialisation.");

namespace moe {
namespace client {

absl::StatusOr<v1::LayerConfig> LayerConfigFromFlags() {
  v1::LayerConfig config;
  config.set_hidden(absl::GetFlag(FLAGS_hidden));
  config.set_ffn(absl::GetFlag(FLAGS_ffn));
  config.set_num_experts(absl::GetFlag(FLAGS_experts));
  config.set_top_k(absl::GetFlag(FLAGS_top_k));

  const std::string score = absl::AsciiStrToLower(absl::GetFlag(FLAGS_score_function));
  if (score == "softmax") {
    config.set_score_function(v1::SCORE_FUNCTION_SOFTMAX);
  } else if (score == "sigmoid") {
    config.set_score_function(v1::SCORE_FUNCTION_SIGMOID);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--score_function: '", score, "' is not softmax or sigmoid"));
  }
  config.set_pre_softmax(absl::GetFlag(FLAGS_pre_softmax));
  config.set_num_groups(absl::GetFlag(FLAGS_num_groups));
  config.set_group_topk(absl::GetFlag(FLAGS_group_topk));
  config.set_scaling_factor(absl::GetFlag(FLAGS_scaling_factor));
  config.set_use_expert_bias(absl::GetFlag(FLAGS_expert_bias));
  config.set_aux_loss_coeff(absl::GetFlag(FLAGS_aux_loss_coeff));
  config.set_z_loss_coeff(absl::GetFlag(FLAGS_z_loss_coeff));
  config.set_capacity_factor(absl::GetFlag(FLAGS_capacity_factor));
  config.set_align_size(absl::GetFlag(FLAGS_align_size));

  const std::string activation = absl::AsciiStrToLower(absl::GetFlag(FLAGS_activation));
  if (activation == "silu") {
    config.set_activation(v1::ACTIVATION_SILU);
  } else if (activation == "gelu") {
    config.set_activation(v1::ACTIVATION_GELU);
  } else if (activation == "relu") {
    config.set_activation(v1::ACTIVATION_RELU);
  } else if (activation == "linear") {
    config.set_activation(v1::ACTIVATION_LINEAR);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--activation: '", activation, "' is not silu, gelu, relu or linear"));
  }
  config.set_gated(absl::GetFlag(FLAGS_gated));
  config.set_use_bias(absl::GetFlag(FLAGS_use_bias));

  const std::string dtype = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_compute_dtype));
  if (dtype != "FP32" && dtype != "BF16" && dtype != "FP8") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--compute_dtype: '", absl::GetFlag(FLAGS_compute_dtype), "' is not fp32, bf16 or fp8"));
  }
  config.set_compute_dtype(dtype);
  const std::string recipe = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_fp8_recipe));
  if (!recipe.empty() && recipe != "DELAYED" && recipe != "CURRENT") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--fp8_recipe: '", absl::GetFlag(FLAGS_fp8_recipe), "' is not delayed or current"));
  }
  config.set_fp8_recipe(recipe);
  const std::string gemms = absl::GetFlag(FLAGS_fp8_gemms);
  const std::string gemms_upper = absl::AsciiStrToUpper(gemms);
  if (gemms_upper == "AUTO" || gemms_upper == "ALL") {
    config.set_fp8_gemms(gemms_upper);
  } else if (!gemms.empty()) {
    const std::string lower = absl::AsciiStrToLower(gemms);
    if (!ParseFp8GemmsPolicy(lower).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fp8_gemms: '", gemms,
          "' is not auto, all, none or a set of fc1_fprop,fc1_dgrad,fc1_wgrad,fc2_fprop,"
          "fc2_dgrad,fc2_wgrad"));
    }
    config.set_fp8_gemms(lower);
  }
  config.set_init_seed(absl::GetFlag(FLAGS_seed));
  return config;
}

namespace {

// "silu" for ACTIVATION_SILU; a value this build does not know (a newer server) is named by
// its number, never an exception.
std::string ActivationText(v1::Activation activation) {
  if (activation == v1::ACTIVATION_UNSPECIFIED) return "silu";
  constexpr absl::string_view kPrefix = "ACTIVATION_";
  const std::string& name = v1::Activation_Name(activation);
  if (!absl::StartsWith(name, kPrefix)) {
    return absl::StrCat("unknown(", static_cast<int>(activation), ")");
  }
  return absl::AsciiStrToLower(name.substr(kPrefix.size()));
}

}  // namespace

std::string DescribeLayerConfig(const v1::LayerConfig& c) {
  std::string out = absl::StrCat(
      "hidden=", c.hidden(), " ffn=", c.ffn(), " experts=", c.num_experts(),
      " top_k=", c.has_top_k() ? c.top_k() : kDefaultTopK,
      " score=", c.score_function() == v1::SCORE_FUNCTION_SIGMOID ? "sigmoid" : "softmax",
      " activation=", ActivationText(c.activation()),
      (c.has_gated() ? c.gated() : kDefaultGated) ? " gated" : " plain", " compute=",
      c.compute_dtype().empty() ? ComputeDTypeName(kDefaultComputeDType) : c.compute_dtype(),
      " seed=", c.init_seed());
  if (c.compute_dtype() == "FP8") {
    absl::StrAppend(&out, " fp8_recipe=", c.fp8_recipe().empty() ? "DELAYED" : c.fp8_recipe(),
                    " fp8_gemms=", c.fp8_gemms().empty() ? "AUTO" : c.fp8_gemms());
  }
  if (c.pre_softmax()) absl::StrAppend(&out, " pre_softmax");
  if (c.num_groups() > 0) {
    absl::StrAppend(&out, " groups=", c.num_groups(), "/top", c.group_topk());
  }
  if (c.has_scaling_factor() && c.scaling_factor() != kDefaultScalingFactor) {
    absl::StrAppend(&out, " scaling=", c.scaling_factor());
  }
  if (c.use_expert_bias()) absl::StrAppend(&out, " expert_bias");
  if (c.aux_loss_coeff() != 0) absl::StrAppend(&out, " aux=", c.aux_loss_coeff());
  if (c.z_loss_coeff() != 0) absl::StrAppend(&out, " z_loss=", c.z_loss_coeff());
  if (c.capacity_factor() != 0) absl::StrAppend(&out, " capacity=", c.capacity_factor());
  if (c.align_size() != 0) absl::StrAppend(&out, " align=", c.align_size());
  if (c.use_bias()) absl::StrAppend(&out, " bias");
  return out;
}

std::string DescribeLayer(const v1::LayerInfo& layer) {
  std::string out = absl::StrCat("  ", layer.name(), "  ", DescribeLayerConfig(layer.config()),
                                 "  ep=", layer.ep_ranks(), " forwards=", layer.forward_count(),
                                 " saved_steps=", layer.saved_steps(), "\n");
  if (!layer.fp8_gemms().empty()) {  // FP8: the GEMMs that quantise; the others run in bf16
    absl::StrAppend(&out, "    fp8_gemms: ", layer.fp8_gemms(), "\n");
  }
  if (layer.durable()) {
    absl::StrAppend(&out, "    optimizer_step=", layer.optimizer_step(),
                    " durable_step=", layer.durable_optimizer_step(), " last_checkpoint=",
                    layer.durable_checkpoint_unix_ms() == 0
                        ? std::string("none (init_seed)")
                        : absl::FormatTime("%Y-%m-%dT%H:%M:%SZ",
                                           absl::FromUnixMillis(layer.durable_checkpoint_unix_ms()),
                                           absl::UTCTimeZone()),
                    "\n");
    if (!layer.durable_error().empty()) {
      absl::StrAppend(&out, "    DURABLE CHECKPOINT FAILED: ", layer.durable_error(), "\n");
    }
  }
  if (layer.weights_reset()) {
    absl::StrAppend(
        &out, "    weights reset to init_seed after a worker was replaced: load a checkpoint\n");
  }
  if (!layer.diverged().empty()) {
    absl::StrAppend(&out, "    DIVERGED: ", layer.diverged(),
                    " (LoadCheckpoint mends it; ZeroGradients does when that was the call)\n");
  }
  return out;
}

}  // namespace client
}  // namespace moe
