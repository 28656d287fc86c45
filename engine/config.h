// The configuration of one MoE layer: every knob of docs/SPEC.md, with its defaults, and the
// validation rules. A config that passes Validate() is one the engine computes exactly.
//
//   LayerConfig config;
//   config.hidden = 1024; config.ffn = 4096; config.num_experts = 8; config.top_k = 2;
//   RETURN_IF_ERROR(ValidateConfig(config, /*ep_ranks=*/2));
#ifndef MOED_ENGINE_CONFIG_H_
#define MOED_ENGINE_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/dtype.h"
#include "engine/fp8_gemms.h"

namespace moe {

enum class ScoreFunction { kSoftmax, kSigmoid };
enum class Activation { kSilu, kGelu, kRelu, kLinear };
// How compute_dtype = FP8 scales its activation and gradient tensors (docs/SPEC.md "FP8"):
// kDelayed from an amax history of earlier steps (TransformerEngine's DelayedScaling),
// kCurrent from this step's own amax (an extra pass over X and d_y).
enum class Fp8Recipe { kDelayed, kCurrent };
// Which amax of the history a delayed scale comes from (TE's amax_compute_algo).
enum class Fp8AmaxAlgo { kMax, kMostRecent };

// TransformerEngine's DelayedScaling defaults.
inline constexpr int64_t kDefaultFp8AmaxHistoryLen = 1024;
inline constexpr int64_t kMaxFp8AmaxHistoryLen = 65536;
inline constexpr int64_t kMaxFp8Margin = 32;

struct LayerConfig {
  int64_t hidden = 0;       // H
  int64_t ffn = 0;          // F, each expert's FFN width
  int64_t num_experts = 0;  // E
  int64_t top_k = 1;        // k

  ScoreFunction score_function = ScoreFunction::kSoftmax;
  bool pre_softmax = false;      // softmax only: select on softmax(z) instead of z
  int64_t num_groups = 0;        // grouped top-k (0 = off)
  int64_t group_topk = 0;        // groups kept (0 = off)
  double scaling_factor = 1.0;   // multiplies the routing weights
  bool use_expert_bias = false;  // sigmoid only; selection-only bias [E]

  double aux_loss_coeff = 0.0;   // 0 = no aux loss
  double z_loss_coeff = 0.0;     // 0 = no z-loss
  double capacity_factor = 0.0;  // 0 = dropless
  int64_t align_size = 0;        // pad each expert's rows to a multiple (0 = off, at most 65536)

  Activation activation = Activation::kSilu;
  bool gated = true;      // wi = [wi_0 | wi_1] (SwiGLU-style) or wi_0 only
  bool use_bias = false;  // wi_0_bias, wi_1_bias, wo_bias

  // kFloat32, kBFloat16, or kFloat8E4M3 for "FP8" (fp8 expert GEMMs, docs/SPEC.md "FP8").
  DType compute_dtype = DType::kFloat32;
  uint64_t init_seed = 0;

  // FP8 only (docs/SPEC.md "FP8"); with another compute_dtype they must keep these defaults.
  Fp8Recipe fp8_recipe = Fp8Recipe::kDelayed;
  int64_t fp8_amax_history_len = kDefaultFp8AmaxHistoryLen;  // 1..65536 steps
  int64_t fp8_margin = 0;                                      // 0..32: scale x 2^margin
  Fp8AmaxAlgo fp8_amax_compute_algo = Fp8AmaxAlgo::kMax;
  // Which expert GEMMs quantise (engine/fp8_gemms.h; docs/SPEC.md "Per-GEMM choice"): AUTO
  // (FP8 only where the backend measured it faster at the layer's shape), ALL, or a set; the
  // others run in bf16 as the BF16 layer runs them.
  Fp8GemmsPolicy fp8_gemms;
};

// Largest align_size ValidateConfig accepts.
constexpr int64_t kMaxAlignSize = 65536;
// Largest sizes ValidateConfig accepts: far beyond any published MoE (DeepSeek-V3: H 7168,
// F 2048, E 256, k 8), small enough that every byte count of the layer's tensors fits an
// int64 with room to spare and a mistyped size is an error, not an allocation failure.
constexpr int64_t kMaxHidden = 65536;
constexpr int64_t kMaxFfn = 262144;
constexpr int64_t kMaxExperts = 65536;
constexpr int64_t kMaxTopK = 1024;

// Checks every rule of docs/SPEC.md (positive sizes, k <= E, grouped top-k rules, expert bias only
// with sigmoid, E % ep_ranks == 0, ...). The error message names the field and the rule.
absl::Status ValidateConfig(const LayerConfig& config, int ep_ranks);

const char* ScoreFunctionName(ScoreFunction f);  // "softmax", "sigmoid"
const char* ActivationName(Activation a);        // "silu", "gelu", "relu", "linear"
absl::StatusOr<ScoreFunction> ParseScoreFunction(absl::string_view name);
absl::StatusOr<Activation> ParseActivation(absl::string_view name);
const char* Fp8RecipeName(Fp8Recipe r);      // "DELAYED", "CURRENT"
const char* Fp8AmaxAlgoName(Fp8AmaxAlgo a);  // "max", "most_recent"
absl::StatusOr<Fp8Recipe> ParseFp8Recipe(absl::string_view name);
absl::StatusOr<Fp8AmaxAlgo> ParseFp8AmaxAlgo(absl::string_view name);

// Names of the compute datatypes: "FP32", "BF16", "FP8" (kFloat8E4M3; case-sensitive).
const char* ComputeDTypeName(DType compute_dtype);
absl::StatusOr<DType> ParseComputeDType(absl::string_view name);

// The datatype the expert path stores its rows in (dispatched x, h, a, y and their
// gradients): the compute dtype, except BF16 under FP8 (GEMM operands are quantised from it).
inline DType ExpertRowDType(const LayerConfig& c) {
  return c.compute_dtype == DType::kFloat8E4M3 ? DType::kBFloat16 : c.compute_dtype;
}

// Width of the fused up projection: 2F when gated, F otherwise.
inline int64_t UpWidth(const LayerConfig& c) { return c.gated ? 2 * c.ffn : c.ffn; }

// The deferral budget of the expert weight gradients (docs/SPEC.md "Weight gradients of several
// backwards"), as a fraction of a rank's wi and wo gradient bytes: MoeLayerOptions (a worker's
// --deferred_wgrad_fraction), by default kDefaultDeferredWgradFraction; a finite number >= 0,
// 0 turns deferral off. INVALID_ARGUMENT naming the flag for anything else. moed's admission
// control reads the workers' values (PingResponse.deferred_wgrad_fraction).
inline constexpr double kDefaultDeferredWgradFraction = 0.125;
absl::Status CheckDeferredWgradFraction(double fraction);
// The budget in bytes on one of `ep_ranks` ranks: `fraction` x its experts' wi and wo fp32
// gradients (0 under FP8, which never defers). A layer holds less than this between calls
// (the backward that reaches it runs every deferred GEMM); a backward that does so allocates,
// beside its own buffers, one gathered copy of the deferred rows of one weight at a time.
int64_t DeferredWgradBudgetBytes(const LayerConfig& config, int ep_ranks, double fraction);

// One line, "key=value ..." of every field: logs, checkpoints and error messages.
std::string ConfigToString(const LayerConfig& config);
absl::StatusOr<LayerConfig> ConfigFromString(absl::string_view text);

}  // namespace moe

#endif  // MOED_ENGINE_CONFIG_H_
