#include "engine/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat("config.", field, ": ", rule));
}

bool IsFiniteNonNegative(double v) { return std::isfinite(v) && v >= 0.0; }

// Doubles are written with 17 significant digits so that parsing gives the same bits back.
std::string DoubleToString(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

const char* BoolName(bool b) { return b ? "true" : "false"; }

absl::StatusOr<bool> ParseBool(absl::string_view key, absl::string_view v) {
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("config.", key, ": '", v, "' is not a boolean (true/false)"));
}

absl::StatusOr<int64_t> ParseInt(absl::string_view key, absl::string_view v) {
  int64_t out;
  if (!absl::SimpleAtoi(v, &out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.", key, ": '", v, "' is not an integer"));
  }
  return out;
}

absl::StatusOr<double> ParseDouble(absl::string_view key, absl::string_view v) {
  double out;
  if (!absl::SimpleAtod(v, &out)) {
    return absl::InvalidArgumentError(absl::StrCat("config.", key, ": '", v, "' is not a number"));
  }
  return out;
}

// The FP8 scaling knobs: in range, and left at their defaults unless compute_dtype is FP8 (a
// knob that would be ignored is an error).
absl::Status ValidateFp8Config(const LayerConfig& c) {
  if (c.fp8_recipe != Fp8Recipe::kDelayed && c.fp8_recipe != Fp8Recipe::kCurrent) {
    return Invalid("fp8_recipe", "must be DELAYED or CURRENT");
  }
  if (c.fp8_amax_compute_algo != Fp8AmaxAlgo::kMax &&
      c.fp8_amax_compute_algo != Fp8AmaxAlgo::kMostRecent) {
    return Invalid("fp8_amax_compute_algo", "must be max or most_recent");
  }
  if (c.fp8_amax_history_len < 1 || c.fp8_amax_history_len > kMaxFp8AmaxHistoryLen) {
    return Invalid("fp8_amax_history_len", absl::StrCat("must be in [1, ", kMaxFp8AmaxHistoryLen,
                                                        "], got ", c.fp8_amax_history_len));
  }
  if (c.fp8_margin < 0 || c.fp8_margin > kMaxFp8Margin) {
    return Invalid("fp8_margin",
                   absl::StrCat("must be in [0, ", kMaxFp8Margin, "], got ", c.fp8_margin));
  }
  if (c.fp8_gemms.kind == Fp8GemmsPolicy::Kind::kSet && (c.fp8_gemms.set & ~kAllFp8Gemms) != 0) {
    return Invalid("fp8_gemms", "names a GEMM that does not exist");
  }
  if (c.compute_dtype == DType::kFloat8E4M3) return absl::OkStatus();
  const LayerConfig defaults;
  for (const auto& [field, is_default] :
       {std::make_pair("fp8_recipe", c.fp8_recipe == defaults.fp8_recipe),
        std::make_pair("fp8_amax_history_len",
                       c.fp8_amax_history_len == defaults.fp8_amax_history_len),
        std::make_pair("fp8_margin", c.fp8_margin == defaults.fp8_margin),
        std::make_pair("fp8_amax_compute_algo",
                       c.fp8_amax_compute_algo == defaults.fp8_amax_compute_algo),
        std::make_pair("fp8_gemms", c.fp8_gemms == defaults.fp8_gemms)}) {
    if (!is_default) return Invalid(field, "only applies to compute_dtype=FP8");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateConfig(const LayerConfig& c, int ep_ranks) {
  if (c.hidden <= 0) return Invalid("hidden", absl::StrCat("must be > 0, got ", c.hidden));
  if (c.ffn <= 0) return Invalid("ffn", absl::StrCat("must be > 0, got ", c.ffn));
  if (c.num_experts <= 0) {
    return Invalid("num_experts", absl::StrCat("must be > 0, got ", c.num_experts));
  }
  if (c.top_k <= 0) return Invalid("top_k", absl::StrCat("must be > 0, got ", c.top_k));
  for (const auto& [field, value, bound] :
       {std::make_tuple("hidden", c.hidden, kMaxHidden), std::make_tuple("ffn", c.ffn, kMaxFfn),
        std::make_tuple("num_experts", c.num_experts, kMaxExperts),
        std::make_tuple("top_k", c.top_k, kMaxTopK)}) {
    if (value > bound) {
      return Invalid(field, absl::StrCat("must be <= ", bound, ", got ", value));
    }
  }
  if (c.top_k > c.num_experts) {
    return Invalid("top_k",
                   absl::StrCat("must be <= num_experts (", c.num_experts, "), got ", c.top_k));
  }
  if (ep_ranks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("ep_ranks: must be > 0, got ", ep_ranks));
  }
  if (c.num_experts % ep_ranks != 0) {
    return Invalid("num_experts", absl::StrCat("must be divisible by the number of EP ranks (",
                                               ep_ranks, "), got ", c.num_experts));
  }
  if (c.score_function != ScoreFunction::kSoftmax && c.score_function != ScoreFunction::kSigmoid) {
    return Invalid("score_function", "must be softmax or sigmoid");
  }
  if (c.pre_softmax && c.score_function != ScoreFunction::kSoftmax) {
    return Invalid("pre_softmax", "only applies to score_function=softmax");
  }
  if (c.use_expert_bias && c.score_function != ScoreFunction::kSigmoid) {
    return Invalid("use_expert_bias", "requires score_function=sigmoid");
  }
  // Grouped top-k (docs/SPEC.md Forward 3): both knobs set or both off.
  if (c.num_groups < 0) return Invalid("num_groups", "must be >= 0");
  if (c.group_topk < 0) return Invalid("group_topk", "must be >= 0");
  if ((c.num_groups > 0) != (c.group_topk > 0)) {
    return Invalid(c.num_groups > 0 ? "group_topk" : "num_groups",
                   "num_groups and group_topk must both be > 0 (grouped top-k) or both 0");
  }
  if (c.num_groups > 0) {
    if (c.num_experts % c.num_groups != 0) {
      return Invalid("num_groups",
                     absl::StrCat("num_experts (", c.num_experts,
                                  ") must be divisible by num_groups (", c.num_groups, ")"));
    }
    if (c.group_topk > c.num_groups) {
      return Invalid("group_topk", absl::StrCat("must be <= num_groups (", c.num_groups, "), got ",
                                                c.group_topk));
    }
    if (c.top_k % c.group_topk != 0) {
      return Invalid("group_topk",
                     absl::StrCat("top_k (", c.top_k, ") must be divisible by group_topk (",
                                  c.group_topk, ")"));
    }
    const int64_t group_size = c.num_experts / c.num_groups;
    if (c.top_k > c.group_topk * group_size) {
      return Invalid("top_k", absl::StrCat("must be <= group_topk * num_experts / num_groups (",
                                           c.group_topk * group_size, "), got ", c.top_k));
    }
  }
  if (!std::isfinite(c.scaling_factor) || c.scaling_factor <= 0.0) {
    return Invalid("scaling_factor", "must be finite and > 0");
  }
  if (!IsFiniteNonNegative(c.aux_loss_coeff)) {
    return Invalid("aux_loss_coeff", "must be finite and >= 0");
  }
  if (!IsFiniteNonNegative(c.z_loss_coeff)) {
    return Invalid("z_loss_coeff", "must be finite and >= 0");
  }
  if (!IsFiniteNonNegative(c.capacity_factor)) {
    return Invalid("capacity_factor", "must be finite and >= 0 (0 = dropless)");
  }
  if (c.align_size < 0) return Invalid("align_size", "must be >= 0 (0 = no padding)");
  // Padding targets GEMM tiles (16..256 in practice); the bound keeps the rounded-up row counts
  // far from overflow (they are int64 sums and int32 row indices).
  if (c.align_size > kMaxAlignSize) {
    return Invalid("align_size",
                   absl::StrCat("must be <= ", kMaxAlignSize, ", got ", c.align_size));
  }
  switch (c.activation) {
    case Activation::kSilu:
    case Activation::kGelu:
    case Activation::kRelu:
    case Activation::kLinear:
      break;
    default:
      return Invalid("activation", "must be silu, gelu, relu or linear");
  }
  if (c.compute_dtype != DType::kFloat32 && c.compute_dtype != DType::kBFloat16 &&
      c.compute_dtype != DType::kFloat8E4M3) {
    return Invalid("compute_dtype",
                   absl::StrCat("must be FP32, BF16 or FP8, got ", DTypeName(c.compute_dtype)));
  }
  return ValidateFp8Config(c);
}

const char* ComputeDTypeName(DType compute_dtype) {
  return compute_dtype == DType::kFloat8E4M3 ? "FP8" : DTypeName(compute_dtype);
}

absl::StatusOr<DType> ParseComputeDType(absl::string_view name) {
  if (name == "FP32") return DType::kFloat32;
  if (name == "BF16") return DType::kBFloat16;
  if (name == "FP8") return DType::kFloat8E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat("compute_dtype: '", name, "' is not FP32, BF16 or FP8"));
}

const char* Fp8RecipeName(Fp8Recipe r) { return r == Fp8Recipe::kCurrent ? "CURRENT" : "DELAYED"; }

const char* Fp8AmaxAlgoName(Fp8AmaxAlgo a) {
  return a == Fp8AmaxAlgo::kMostRecent ? "most_recent" : "max";
}

absl::StatusOr<Fp8Recipe> ParseFp8Recipe(absl::string_view name) {
  for (Fp8Recipe r : {Fp8Recipe::kDelayed, Fp8Recipe::kCurrent}) {
    if (name == Fp8RecipeName(r)) return r;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("fp8_recipe: '", name, "' is not DELAYED or CURRENT"));
}

absl::StatusOr<Fp8AmaxAlgo> ParseFp8AmaxAlgo(absl::string_view name) {
  for (Fp8AmaxAlgo a : {Fp8AmaxAlgo::kMax, Fp8AmaxAlgo::kMostRecent}) {
    if (name == Fp8AmaxAlgoName(a)) return a;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("fp8_amax_compute_algo: '", name, "' is not max or most_recent"));
}

const char* ScoreFunctionName(ScoreFunction f) {
  switch (f) {
    case ScoreFunction::kSoftmax:
      return "softmax";
    case ScoreFunction::kSigmoid:
      return "sigmoid";
  }
  return "unknown";
}

const char* ActivationName(Activation a) {
  switch (a) {
    case Activation::kSilu:
      return "silu";
    case Activation::kGelu:
      return "gelu";
    case Activation::kRelu:
      return "relu";
    case Activation::kLinear:
      return "linear";
  }
  return "unknown";
}

absl::StatusOr<ScoreFunction> ParseScoreFunction(absl::string_view name) {
  for (ScoreFunction f : {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid}) {
    if (name == ScoreFunctionName(f)) return f;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("score_function: unknown '", name, "' (softmax, sigmoid)"));
}

absl::StatusOr<Activation> ParseActivation(absl::string_view name) {
  for (Activation a :
       {Activation::kSilu, Activation::kGelu, Activation::kRelu, Activation::kLinear}) {
    if (name == ActivationName(a)) return a;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("activation: unknown '", name, "' (silu, gelu, relu, linear)"));
}

std::string ConfigToString(const LayerConfig& c) {
  return absl::StrCat(
      "hidden=", c.hidden, " ffn=", c.ffn, " num_experts=", c.num_experts, " top_k=", c.top_k,
      " score_function=", ScoreFunctionName(c.score_function),
      " pre_softmax=", BoolName(c.pre_softmax), " num_groups=", c.num_groups,
      " group_topk=", c.group_topk, " scaling_factor=", DoubleToString(c.scaling_factor),
      " use_expert_bias=", BoolName(c.use_expert_bias),
      " aux_loss_coeff=", DoubleToString(c.aux_loss_coeff),
      " z_loss_coeff=", DoubleToString(c.z_loss_coeff),
      " capacity_factor=", DoubleToString(c.capacity_factor), " align_size=", c.align_size,
      " activation=", ActivationName(c.activation), " gated=", BoolName(c.gated),
      " use_bias=", BoolName(c.use_bias), " compute_dtype=", ComputeDTypeName(c.compute_dtype),
      " init_seed=", c.init_seed, " fp8_recipe=", Fp8RecipeName(c.fp8_recipe),
      " fp8_amax_history_len=", c.fp8_amax_history_len, " fp8_margin=", c.fp8_margin,
      " fp8_amax_compute_algo=", Fp8AmaxAlgoName(c.fp8_amax_compute_algo),
      " fp8_gemms=", Fp8GemmsPolicyName(c.fp8_gemms));
}

// Every key must be known and appear at most once; keys left out keep their defaults.
// The result is not validated (the EP size is not known here): callers run ValidateConfig.
absl::StatusOr<LayerConfig> ConfigFromString(absl::string_view text) {
  LayerConfig c;
  std::set<std::string> seen;
  for (absl::string_view item : absl::StrSplit(text, absl::ByAnyChar(" \t\n"), absl::SkipEmpty())) {
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("config: '", item, "' is not key=value"));
    }
    const std::string key(item.substr(0, eq));
    const absl::string_view v = item.substr(eq + 1);
    if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(absl::StrCat("config.", key, ": given twice"));
    }
    if (key == "hidden") {
      ASSIGN_OR_RETURN(c.hidden, ParseInt(key, v));
    } else if (key == "ffn") {
      ASSIGN_OR_RETURN(c.ffn, ParseInt(key, v));
    } else if (key == "num_experts") {
      ASSIGN_OR_RETURN(c.num_experts, ParseInt(key, v));
    } else if (key == "top_k") {
      ASSIGN_OR_RETURN(c.top_k, ParseInt(key, v));
    } else if (key == "score_function") {
      ASSIGN_OR_RETURN(c.score_function, ParseScoreFunction(v));
    } else if (key == "pre_softmax") {
      ASSIGN_OR_RETURN(c.pre_softmax, ParseBool(key, v));
    } else if (key == "num_groups") {
      ASSIGN_OR_RETURN(c.num_groups, ParseInt(key, v));
    } else if (key == "group_topk") {
      ASSIGN_OR_RETURN(c.group_topk, ParseInt(key, v));
    } else if (key == "scaling_factor") {
      ASSIGN_OR_RETURN(c.scaling_factor, ParseDouble(key, v));
    } else if (key == "use_expert_bias") {
      ASSIGN_OR_RETURN(c.use_expert_bias, ParseBool(key, v));
    } else if (key == "aux_loss_coeff") {
      ASSIGN_OR_RETURN(c.aux_loss_coeff, ParseDouble(key, v));
    } else if (key == "z_loss_coeff") {
      ASSIGN_OR_RETURN(c.z_loss_coeff, ParseDouble(key, v));
    } else if (key == "capacity_factor") {
      ASSIGN_OR_RETURN(c.capacity_factor, ParseDouble(key, v));
    } else if (key == "align_size") {
      ASSIGN_OR_RETURN(c.align_size, ParseInt(key, v));
    } else if (key == "activation") {
      ASSIGN_OR_RETURN(c.activation, ParseActivation(v));
    } else if (key == "gated") {
      ASSIGN_OR_RETURN(c.gated, ParseBool(key, v));
    } else if (key == "use_bias") {
      ASSIGN_OR_RETURN(c.use_bias, ParseBool(key, v));
    } else if (key == "compute_dtype") {
      ASSIGN_OR_RETURN(c.compute_dtype, ParseComputeDType(v));
    } else if (key == "init_seed") {
      uint64_t seed;
      if (!absl::SimpleAtoi(v, &seed)) {
        return absl::InvalidArgumentError(
            absl::StrCat("config.init_seed: '", v, "' is not an unsigned integer"));
      }
      c.init_seed = seed;
    } else if (key == "fp8_recipe") {  // absent before issue 40: the defaults apply
      ASSIGN_OR_RETURN(c.fp8_recipe, ParseFp8Recipe(v));
    } else if (key == "fp8_amax_history_len") {
      ASSIGN_OR_RETURN(c.fp8_amax_history_len, ParseInt(key, v));
    } else if (key == "fp8_margin") {
      ASSIGN_OR_RETURN(c.fp8_margin, ParseInt(key, v));
    } else if (key == "fp8_amax_compute_algo") {
      ASSIGN_OR_RETURN(c.fp8_amax_compute_algo, ParseFp8AmaxAlgo(v));
    } else if (key == "fp8_gemms") {  // absent before the per-GEMM choice: AUTO
      ASSIGN_OR_RETURN(c.fp8_gemms, ParseFp8GemmsPolicy(v));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    }
  }
  return c;
}

absl::Status CheckDeferredWgradFraction(double fraction) {
  if (!std::isfinite(fraction) || fraction < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "deferred_wgrad_fraction must be a number >= 0 (0 turns deferral off), got ", fraction));
  }
  return absl::OkStatus();
}

int64_t DeferredWgradBudgetBytes(const LayerConfig& config, int ep_ranks, double fraction) {
  if (config.compute_dtype == DType::kFloat8E4M3 || !(fraction > 0)) return 0;
  const long double experts = static_cast<long double>(config.num_experts) / std::max(ep_ranks, 1);
  const long double gradient_bytes = experts * sizeof(float) *
                                     (static_cast<long double>(config.hidden) * UpWidth(config) +
                                      static_cast<long double>(config.ffn) * config.hidden);
  const long double budget = static_cast<long double>(fraction) * gradient_bytes;
  return budget >= static_cast<long double>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(budget);
}

}  // namespace moe
