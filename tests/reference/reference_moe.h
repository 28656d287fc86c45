// An independent, naive, double-precision reference of the MoE layer of docs/SPEC.md.
//
// Written from docs/SPEC.md alone and sharing no code with engine/ (not even its config): the tests
// convert an engine LayerConfig into a RefConfig with a small adapter. Everything is dense and
// per token: for each token, each of its selected experts' FFN is evaluated directly on that
// token's row; there is no permutation, padding or communication, so align_size has no place
// here (SPEC: it does not change the maths). Capacity uses T = the tokens given (one rank).
//
//   RefConfig config = ...;
//   RefParams params = RefParams::Zeros(config);  // then fill gate, wi, wo, ...
//   RefForwardResult fwd = RefForward(config, params, x, tokens);
//   RefGradients grads = RefBackward(config, params, x, tokens, fwd, d_out, d_aux, d_zl);
//
// Layouts (row-major): x, out [T, H]; gate [H, E]; wi [E, H, up] (up = 2F gated: wi_0 | wi_1,
// else F); wo [E, F, H]; wi_bias [E, up]; wo_bias [E, H]; expert_bias [E]; [T, E] for every
// per-(token, expert) quantity below.
#ifndef MOED_TESTS_REFERENCE_REFERENCE_MOE_H_
#define MOED_TESTS_REFERENCE_REFERENCE_MOE_H_

#include <cstdint>
#include <string>
#include <vector>

namespace moe_ref {

enum class RefScore { kSoftmax, kSigmoid };
enum class RefActivation { kSilu, kGelu, kRelu, kLinear };

// The knobs of docs/SPEC.md that change the maths (mirrors, does not include, the engine's config).
struct RefConfig {
  int64_t hidden = 0;       // H
  int64_t ffn = 0;          // F
  int64_t num_experts = 0;  // E
  int64_t top_k = 1;        // k
  RefScore score = RefScore::kSoftmax;
  bool pre_softmax = false;
  int64_t num_groups = 0;
  int64_t group_topk = 0;
  double scaling_factor = 1.0;
  bool use_expert_bias = false;
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  double capacity_factor = 0.0;
  RefActivation activation = RefActivation::kSilu;
  bool gated = true;
  bool use_bias = false;

  int64_t up() const { return gated ? 2 * ffn : ffn; }
  std::string ToString() const;
};

struct RefParams {
  std::vector<double> gate;         // [H, E]
  std::vector<double> expert_bias;  // [E] (zeros when unused)
  std::vector<double> wi;           // [E, H, up]
  std::vector<double> wo;           // [E, F, H]
  std::vector<double> wi_bias;      // [E, up] (zeros when unused)
  std::vector<double> wo_bias;      // [E, H] (zeros when unused)
  static RefParams Zeros(const RefConfig& config);
};

// The routing decisions of one forward.
struct RefRouting {
  std::vector<uint8_t> selected;  // [T, E] 1 if e is in S_t
  std::vector<uint8_t> kept;      // [T, E] 1 if (t, e) is selected and survives capacity
  std::vector<double> p;          // [T, E] routing weight p of SPEC Forward 2 on S_t, else 0
  std::vector<double> probs;      // [T, E] scaling_factor * p on S_t, 0 elsewhere
  std::vector<double> scores;     // [T, E] softmax(z) (softmax) or sigmoid(z) (sigmoid)
  int64_t capacity = -1;          // pairs kept per expert, -1 = dropless
  // Smallest non-zero gap at a decision boundary (k-th vs (k+1)-th selection score, the kept
  // groups vs the best dropped group, the last kept vs the first dropped pair of an expert over
  // capacity). A small value means fp32 and fp64 may decide differently; an exact tie (gap 0)
  // is decided by the index rules of docs/SPEC.md in both, so it is not counted.
  double min_selection_gap = 1e300;
  double min_capacity_gap = 1e300;
  bool SameDecisions(const RefRouting& other) const {
    return selected == other.selected && kept == other.kept;
  }
};

struct RefForwardResult {
  int64_t tokens = 0;
  std::vector<double> logits;  // [T, E]
  RefRouting routing;
  std::vector<double> out;  // [T, H]
  double aux_loss = 0.0;
  double z_loss = 0.0;
  std::vector<int64_t> tokens_per_expert;  // [E] selected pairs, before capacity drops
  // The selected pairs of each token in ascending expert order, for the backward:
  // pair_expert [T, k]; h [T, k, up] (with bias) and y [T, k, H], zeros for dropped pairs.
  std::vector<int32_t> pair_expert;
  std::vector<double> h;
  std::vector<double> y;
};

struct RefGradients {
  std::vector<double> d_x;        // [T, H]
  std::vector<double> d_gate;     // [H, E]
  std::vector<double> d_wi;       // [E, H, up]
  std::vector<double> d_wo;       // [E, F, H]
  std::vector<double> d_wi_bias;  // [E, up]
  std::vector<double> d_wo_bias;  // [E, H]
};

// The routing of docs/SPEC.md Forward 2-4 and 7 for the given logits.
RefRouting RefRoute(const RefConfig& config, const RefParams& params,
                    const std::vector<double>& logits, int64_t tokens);

RefForwardResult RefForward(const RefConfig& config, const RefParams& params,
                            const std::vector<double>& x, int64_t tokens);

// Analytic gradients of L = <out, d_out> + d_aux * aux + d_zl * z_loss at the point of `fwd`.
RefGradients RefBackward(const RefConfig& config, const RefParams& params,
                         const std::vector<double>& x, const RefForwardResult& fwd,
                         const std::vector<double>& d_out, double d_aux, double d_zl);

// Activation and its derivative (gelu: tanh approximation).
double RefAct(RefActivation act, double v);
double RefActGrad(RefActivation act, double v);

}  // namespace moe_ref

#endif  // MOED_TESTS_REFERENCE_REFERENCE_MOE_H_
