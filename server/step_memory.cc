#include "server/step_memory.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "proto/layer_info.h"

namespace moe {
namespace {

constexpr long double kMaxBytes = static_cast<long double>(std::numeric_limits<int64_t>::max());

int64_t Saturate(long double bytes) {
  return bytes >= kMaxBytes ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(bytes);
}

// Rows of one worker's layouts at worst-case routing (long double: no overflow).
struct Rows {
  long double tokens;  // this worker's tokens: ceil(T / R)
  long double local;   // its own tokens' pairs, padded: Forward 8's local layout
  long double expert;  // pairs its experts receive from every rank, padded: Forward 9's layout
};

Rows WorstCaseRows(const LayerConfig& c, int64_t tokens, int ranks) {
  const long double R = std::max(ranks, 1);
  const long double E = static_cast<long double>(c.num_experts);
  const long double K = static_cast<long double>(c.top_k);
  const long double local_experts = std::max<long double>(E / R, 1);
  const long double pad = c.align_size > 1 ? static_cast<long double>(c.align_size - 1) : 0;
  Rows rows;
  rows.tokens = std::ceil(static_cast<long double>(tokens) / R);
  rows.local = rows.tokens * K + E * pad;
  // A token's k experts are distinct: at most min(k, E/R) of them live on one rank.
  long double pairs_in = static_cast<long double>(tokens) * std::min(K, local_experts);
  if (c.capacity_factor > 0) {
    // Each source rank keeps at most ceil(cf * T_r * k / E) pairs per expert.
    const long double capacity =
        std::min(std::ceil(c.capacity_factor * rows.tokens * K / E), rows.tokens);
    pairs_in = std::min(pairs_in, R * local_experts * capacity);
  }
  rows.expert = pairs_in + R * local_experts * pad;
  return rows;
}

}  // namespace

int64_t LayerBytesPerWorker(const LayerConfig& config, int ranks, double deferred_wgrad_fraction) {
  const long double R = std::max(ranks, 1);
  const long double compute_copy =
      ExpertRowDType(config) == DType::kFloat32 ? 0 : DTypeSize(ExpertRowDType(config));
  long double bytes = 0;
  for (const ParameterLayout& p : LayerParameters(config)) {
    long double elements = 1;
    for (int64_t d : p.shape) elements *= static_cast<long double>(d);
    if (p.expert_sharded) elements /= R;
    // fp32 master, and with a gradient: the gradient and two optimizer states.
    const long double per_element = (p.has_gradient ? 4 : 1) * sizeof(float);
    bytes += elements * (per_element + (p.expert_sharded ? compute_copy : 0));
  }
  bytes +=
      static_cast<long double>(DeferredWgradBudgetBytes(config, ranks, deferred_wgrad_fraction));
  return Saturate(bytes);
}

int64_t ForwardStepBytes(const LayerConfig& c, int64_t tokens, int ranks, DType x_dtype) {
  const Rows rows = WorstCaseRows(c, tokens, ranks);
  const long double H = c.hidden, F = c.ffn, up = UpWidth(c), E = c.num_experts, K = c.top_k;
  const long double cs = DTypeSize(ExpertRowDType(c)), xs = DTypeSize(x_dtype);
  // Per token: x as uploaded, its fp32 and compute views, logits and scores [E] fp32, top-k
  // experts, weights, kept flags and pair rows, the output; the CUDA backend's logits GEMM
  // on bf16 tensor cores adds three [E] fp32 partial sums (and the gate's three bf16 parts,
  // below).
  const long double per_token = H * (xs + 4 + cs + xs) + E * (8 + 12) + K * (4 + 4 + 1 + 4);
  // Per local row: the permuted x and the combined-back y (compute dtype), the row map.
  const long double per_local_row = 2 * H * cs + 4;
  // Per expert row: dispatched x, h [up], activation [F], y [H]; FP8 adds the quantised
  // copies of x and of the activation (one byte per element).
  long double per_expert_row = (H + up + F + H) * cs;
  if (c.compute_dtype == DType::kFloat8E4M3) per_expert_row += H + F;
  return Saturate(rows.tokens * per_token + rows.local * per_local_row +
                  rows.expert * per_expert_row + H * E * 3 * 2);
}

int64_t BackwardStepBytes(const LayerConfig& c, int64_t tokens, int ranks, DType x_dtype,
                          double deferred_wgrad_fraction) {
  const Rows rows = WorstCaseRows(c, tokens, ranks);
  const long double H = c.hidden, F = c.ffn, up = UpWidth(c), E = c.num_experts, K = c.top_k;
  const long double cs = DTypeSize(ExpertRowDType(c)), xs = DTypeSize(x_dtype);
  // Per token: d_out as uploaded, d_x fp32 and cast, d_logits [E] (and, for the CUDA
  // backend's tensor-core GEMMs, one at a time: its three bf16 parts for d_gate's, or six for
  // d_x's from E = 128, 12 bytes per expert), d_probs [k].
  const long double per_token = H * (xs + 4 + xs) + E * (4 + 12) + K * 4;
  // Per local row: d_y in the local layout. Per expert row: d_y and d_x in the expert
  // layout, d_act [F], d_h [up]; FP8 adds quantised copies.
  const long double per_local_row = H * cs;
  long double per_expert_row = (2 * H + F + up) * cs;
  if (c.compute_dtype == DType::kFloat8E4M3) per_expert_row += H + up;
  // The flush of deferred weight gradients (engine/moe_layer_experts.cc,
  // DeferredWeightGradGemms) gathers the kept rows (below the budget) and this step's, of wi's
  // operands [x | d_h] or wo's [act | d_y].
  const long double budget =
      static_cast<long double>(DeferredWgradBudgetBytes(c, ranks, deferred_wgrad_fraction));
  const long double flush = budget > 0 ? budget + rows.expert * std::max(H + up, F + H) * cs : 0;
  // The gate's per-step gradient [H, E] fp32 (and d_gate's three [H, E] fp32 partial sums, or
  // the gate's six bf16 parts for d_x's GEMM: 12 H E bytes either way).
  return Saturate(rows.tokens * per_token + rows.local * per_local_row +
                  rows.expert * per_expert_row + H * E * 4 * (1 + 3) + flush);
}

}  // namespace moe
