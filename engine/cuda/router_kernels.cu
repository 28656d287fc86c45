// Router kernels (docs/SPEC.md Forward 1-6, Backward 5): one warp per token, fp32, deterministic.
//
// Each warp keeps its token's selection scores in shared memory ([warps][E] floats, then
// [warps][E] floats of group scores and [warps][E] ints of kept-group flags). Top-k is k rounds of a warp arg-max that
// takes the best element strictly after the previous pick in the order (score descending,
// index ascending): ties go to the lower expert index and nothing needs marking.
#include <cuda_runtime.h>

#include <cmath>

#include "engine/cuda/kernels.cuh"

namespace moe {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kLossChunk = 128;  // tokens per block of the loss-partials reduction

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// True when (v, i) comes before (bv, bi) in (value descending, index ascending); bi < 0 = none.
__device__ __forceinline__ bool Before(float v, int i, float bv, int bi) {
  return bi < 0 || v > bv || (v == bv && i < bi);
}
// True when (v, i) comes strictly after (pv, pi) in the same order.
__device__ __forceinline__ bool After(float v, int i, float pv, int pi) {
  return v < pv || (v == pv && i > pi);
}
__device__ __forceinline__ void WarpArgBest(float& bv, int& bi) {
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi >= 0 && Before(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
}

// Forward 1-2, the warp of token t: its scores (softmax or sigmoid), logsumexp and score sum,
// and its selection values sel[E]: sigmoid score plus expert bias, softmax score (pre_softmax)
// or logit.
__device__ __forceinline__ void RouterScores(const RouterParams& p, int64_t t, int lane,
                                             const float* __restrict__ z,
                                             const float* __restrict__ expert_bias, float* sel,
                                             float* __restrict__ scores,
                                             float* __restrict__ logsumexp,
                                             float* __restrict__ score_sum) {
  const int E = p.num_experts;
  float m = -INFINITY;
  for (int e = lane; e < E; e += kWarp) m = fmaxf(m, z[e]);
  m = WarpMax(m);
  float s = 0.f;
  for (int e = lane; e < E; e += kWarp) s += expf(z[e] - m);
  s = WarpSum(s);
  const float lse = m + logf(s);
  float ssum = 0.f;
  for (int e = lane; e < E; e += kWarp) {
    const float zi = z[e];
    const float sc = p.sigmoid ? 1.f / (1.f + expf(-zi)) : expf(zi - lse);
    scores[t * E + e] = sc;
    ssum += sc;
    sel[e] = p.sigmoid ? sc + (expert_bias ? expert_bias[e] : 0.f) : (p.pre_softmax ? sc : zi);
  }
  ssum = WarpSum(ssum);
  if (lane == 0) {
    logsumexp[t] = lse;
    score_sum[t] = ssum;
  }
  __syncwarp();
}

// Grouped top-k: a group's score is the sum of its per_group best selection values; the
// experts of all but the group_topk best groups leave the selection (-inf).
__device__ __forceinline__ void KeepBestGroups(const RouterParams& p, int lane, float* sel,
                                               float* group_score, int* group_kept) {
  const int E = p.num_experts;
  const int G = p.num_groups, gsize = E / G, per_group = p.top_k / p.group_topk;
  for (int g = lane; g < G; g += kWarp) {
    float pv = INFINITY, sum = 0.f;
    int pi = -1;
    for (int r = 0; r < per_group; ++r) {
      float bv = 0.f;
      int bi = -1;
      for (int i = 0; i < gsize; ++i) {
        const int e = g * gsize + i;
        const float v = sel[e];
        if (After(v, e, pv, pi) && Before(v, e, bv, bi)) {
          bv = v;
          bi = e;
        }
      }
      if (bi < 0) break;
      sum += bv;
      pv = bv;
      pi = bi;
    }
    group_score[g] = sum;
  }
  __syncwarp();
  // A group is kept when fewer than group_topk groups come before it.
  for (int g = lane; g < G; g += kWarp) {
    int rank = 0;
    for (int h = 0; h < G; ++h) {
      if (h != g && Before(group_score[h], h, group_score[g], g)) ++rank;
    }
    group_kept[g] = rank < p.group_topk ? 1 : 0;
  }
  __syncwarp();
  for (int e = lane; e < E; e += kWarp) {
    if (!group_kept[e / gsize]) sel[e] = -INFINITY;
  }
  __syncwarp();
}

// Top-k by k rounds of a warp arg-max (see the top of the file); lane 0 writes experts_out[k].
__device__ __forceinline__ void SelectTopK(const RouterParams& p, int lane, const float* sel,
                                           int32_t* experts_out) {
  const int E = p.num_experts;
  float pv = INFINITY;
  int pi = -1;
  for (int r = 0; r < p.top_k; ++r) {
    float bv = 0.f;
    int bi = -1;
    for (int e = lane; e < E; e += kWarp) {
      const float v = sel[e];
      if (After(v, e, pv, pi) && Before(v, e, bv, bi)) {
        bv = v;
        bi = e;
      }
    }
    WarpArgBest(bv, bi);
    if (bi < 0) bi = 0;  // only when scores are NaN: keep indices valid
    pv = bv;
    pi = bi;
    if (lane == 0) experts_out[r] = bi;
  }
  __syncwarp();
}

// One thread per token t: the routing weights of its k experts, and the experts' counts.
__device__ __forceinline__ void TopKWeights(const RouterParams& p, int64_t t,
                                            const float* __restrict__ z,
                                            const float* __restrict__ scores,
                                            const int32_t* experts_out,
                                            float* __restrict__ topk_weight,
                                            int32_t* __restrict__ expert_counts) {
  const int E = p.num_experts;
  float* w = topk_weight + t * p.top_k;
  const int k = p.top_k;
  if (p.sigmoid) {
    float den = 0.f;
    for (int j = 0; j < k; ++j) den += scores[t * E + experts_out[j]];
    for (int j = 0; j < k; ++j) {
      const float sj = scores[t * E + experts_out[j]];
      w[j] = p.scaling_factor * (k > 1 ? sj / (den + 1e-20f) : sj);
    }
  } else if (p.pre_softmax) {
    for (int j = 0; j < k; ++j) w[j] = p.scaling_factor * scores[t * E + experts_out[j]];
  } else {
    float mz = -INFINITY, den = 0.f;
    for (int j = 0; j < k; ++j) mz = fmaxf(mz, z[experts_out[j]]);
    for (int j = 0; j < k; ++j) den += expf(z[experts_out[j]] - mz);
    for (int j = 0; j < k; ++j) w[j] = p.scaling_factor * expf(z[experts_out[j]] - mz) / den;
  }
  for (int j = 0; j < k; ++j) atomicAdd(&expert_counts[experts_out[j]], 1);  // integers
}

__global__ void RouterForwardKernel(RouterParams p, const float* __restrict__ logits,
                                    const float* __restrict__ expert_bias,
                                    int32_t* __restrict__ topk_expert,
                                    float* __restrict__ topk_weight, float* __restrict__ scores,
                                    float* __restrict__ logsumexp,
                                    int32_t* __restrict__ expert_counts,
                                    float* __restrict__ score_sum) {
  extern __shared__ float smem[];
  const int E = p.num_experts;
  const int warps = blockDim.x / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float* sel = smem + warp * E;
  float* group_score = smem + warps * E + warp * E;
  int* group_kept = reinterpret_cast<int*>(smem + 2 * warps * E) + warp * E;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp;
  if (t >= p.tokens) return;
  const float* z = logits + t * E;

  RouterScores(p, t, lane, z, expert_bias, sel, scores, logsumexp, score_sum);
  if (p.num_groups > 0 && p.group_topk > 0) KeepBestGroups(p, lane, sel, group_score, group_kept);
  int32_t* experts_out = topk_expert + t * p.top_k;
  SelectTopK(p, lane, sel, experts_out);
  if (lane == 0) TopKWeights(p, t, z, scores, experts_out, topk_weight, expert_counts);
}

// partial[b, e] = sum over block b's tokens of P[t, e] (e < E) or lse^2 (e == E), fixed order.
__global__ void LossPartialsKernel(int64_t tokens, int E, bool sigmoid,
                                   const float* __restrict__ scores,
                                   const float* __restrict__ logsumexp,
                                   const float* __restrict__ score_sum, double* partial) {
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kLossChunk;
  const int64_t t1 = min(t0 + kLossChunk, tokens);
  for (int col = threadIdx.x; col <= E; col += blockDim.x) {
    double acc = 0.0;
    for (int64_t t = t0; t < t1; ++t) {
      if (col == E) {
        const double l = logsumexp[t];
        acc += l * l;
      } else {
        const float sc = scores[t * E + col];
        acc += sigmoid ? static_cast<double>(sc) / score_sum[t] : static_cast<double>(sc);
      }
    }
    partial[blockIdx.x * static_cast<int64_t>(E + 1) + col] = acc;
  }
}

__global__ void LossFinalKernel(int blocks, int E, const double* partial, double* out) {
  for (int col = blockIdx.x * blockDim.x + threadIdx.x; col <= E; col += gridDim.x * blockDim.x) {
    double acc = 0.0;
    for (int b = 0; b < blocks; ++b) acc += partial[b * static_cast<int64_t>(E + 1) + col];
    out[col] = acc;
  }
}

// Backward 5 on the token's selected set S (experts ex[k], the weights' gradient dw[k]), one
// thread: g on S (for sigmoid the gradient of the selection scores; for softmax the final d_z
// on S). `rest`: the score mass outside S (softmax pre-selection). Returns sum over S of
// g_j s_j for softmax pre-selection, else 0.
__device__ __forceinline__ float SelectedSetGrad(const RouterParams& p, const float* z,
                                                 const float* s, const int32_t* ex, const float* dw,
                                                 float rest, float* g) {
  const int k = p.top_k;
  const float sf = p.scaling_factor;
  float dot_pre = 0.f;
  if (p.sigmoid) {
    if (k > 1) {
      // p_j = s_j / den; d s_i = (1/den) [sum_j p_j (g_i - g_j) + g_i (1 - sum_j p_j)].
      float den = 0.f;
      for (int j = 0; j < k; ++j) den += s[ex[j]];
      den += 1e-20f;
      for (int i = 0; i < k; ++i) {
        const float gi = sf * dw[i];
        float acc = gi * (1e-20f / den);
        for (int j = 0; j < k; ++j) {
          if (j != i) acc += (s[ex[j]] / den) * (gi - sf * dw[j]);
        }
        g[ex[i]] = acc / den;
      }
    } else {
      g[ex[0]] = sf * dw[0];
    }
  } else if (p.pre_softmax) {
    for (int j = 0; j < k; ++j) dot_pre += sf * dw[j] * s[ex[j]];
    for (int i = 0; i < k; ++i) {
      const float gi = sf * dw[i];
      float acc = gi * rest;
      for (int j = 0; j < k; ++j) {
        if (j != i) acc += s[ex[j]] * (gi - sf * dw[j]);
      }
      g[ex[i]] = s[ex[i]] * acc;  // the final d_z on S
    }
  } else {
    float mz = -INFINITY, den = 0.f;
    for (int j = 0; j < k; ++j) mz = fmaxf(mz, z[ex[j]]);
    for (int j = 0; j < k; ++j) den += expf(z[ex[j]] - mz);
    for (int i = 0; i < k; ++i) {
      const float gi = sf * dw[i];
      float acc = 0.f;
      for (int j = 0; j < k; ++j) {
        if (j != i) acc += (expf(z[ex[j]] - mz) / den) * (gi - sf * dw[j]);
      }
      g[ex[i]] = (expf(z[ex[i]] - mz) / den) * acc;
    }
  }
  return dot_pre;
}

// The warp of token t: its d_logits through the score function (g and membership in_s on S),
// plus the aux loss's gradient (aux_grad [E]; null: none) and the z-loss's (z_scale; 0: none).
__device__ __forceinline__ void WriteLogitGrad(const RouterParams& p, int64_t t, int lane,
                                               const float* z, const float* s, const float* g,
                                               const int* in_s, float dot_pre,
                                               const float* __restrict__ aux_grad, float z_scale,
                                               float lse, float* __restrict__ d_logits) {
  const int E = p.num_experts;
  float ssum = 0.f, adot = 0.f;
  if (aux_grad != nullptr) {
    for (int e = lane; e < E; e += kWarp) {
      ssum += s[e];
      adot += aux_grad[e] * s[e];
    }
    ssum = WarpSum(ssum);
    adot = WarpSum(adot);
  }
  for (int e = lane; e < E; e += kWarp) {
    const float se = s[e], ge = g[e];
    float dz;
    if (p.sigmoid) {
      dz = ge * se * (1.f - se);
    } else if (p.pre_softmax) {
      dz = in_s[e] ? ge : -se * dot_pre;
    } else {
      dz = ge;
    }
    if (aux_grad != nullptr) {
      if (p.sigmoid) {
        // P = s / sum(s): dP/ds_e = (a_e - sum_j a_j P_j) / sum(s), then through the sigmoid.
        const float ds = (aux_grad[e] - adot / ssum) / ssum;
        dz += ds * se * (1.f - se);
      } else {
        dz += se * (aux_grad[e] - adot);
      }
    }
    if (z_scale != 0.f) dz += z_scale * 2.f * lse * expf(z[e] - lse);
    d_logits[t * E + e] = dz;
  }
}

// Backward through the routing weights (docs/SPEC.md Backward 5). The Jacobian-vector products
// g_i - sum_j g_j p_j are evaluated pairwise, sum_{j != i} p_j (g_i - g_j) (+ g_i times the
// probability mass outside the sum), which is the same in exact arithmetic but keeps its
// accuracy when one probability is ~1 and the others ~0: there the direct form cancels to
// zero in fp32 while the true value is tiny but not zero (the CPU reference is fp64).
__global__ void RouterBackwardKernel(RouterParams p, const float* __restrict__ logits,
                                     const float* __restrict__ scores,
                                     const float* __restrict__ logsumexp,
                                     const int32_t* __restrict__ topk_expert,
                                     const float* __restrict__ d_topk_weight,
                                     const float* __restrict__ aux_grad, float z_scale,
                                     float* __restrict__ d_logits) {
  extern __shared__ float smem[];
  const int E = p.num_experts, k = p.top_k;
  const int warps = blockDim.x / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float* g = smem + warp * E;                                       // value on S
  int* in_s = reinterpret_cast<int*>(smem + warps * E) + warp * E;  // membership of S
  const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp;
  if (t >= p.tokens) return;
  const float* z = logits + t * E;
  const float* s = scores + t * E;
  const int32_t* ex = topk_expert + t * k;
  const float* dw = d_topk_weight + t * k;
  for (int e = lane; e < E; e += kWarp) {
    g[e] = 0.f;
    in_s[e] = 0;
  }
  __syncwarp();
  for (int j = lane; j < k; j += kWarp) in_s[ex[j]] = 1;
  __syncwarp();
  // Score mass outside S (softmax pre-selection), summed directly, not as 1 - sum over S.
  float rest = 0.f;
  if (!p.sigmoid && p.pre_softmax) {
    for (int e = lane; e < E; e += kWarp) rest += in_s[e] ? 0.f : s[e];
    rest = WarpSum(rest);
  }
  float dot_pre = 0.f;  // softmax pre-selection: sum over S of g_j s_j
  if (lane == 0) dot_pre = SelectedSetGrad(p, z, s, ex, dw, rest, g);
  dot_pre = __shfl_sync(0xffffffffu, dot_pre, 0);
  __syncwarp();
  WriteLogitGrad(p, t, lane, z, s, g, in_s, dot_pre, aux_grad, z_scale, logsumexp[t], d_logits);
}

int WarpsPerBlock(int num_experts, int arrays) {
  int warps = 8;
  while (warps > 1 && static_cast<size_t>(warps) * arrays * num_experts * 4 > 48 * 1024) warps /= 2;
  return warps;
}

size_t AlignUp(size_t v) { return (v + 255) / 256 * 256; }

}  // namespace

size_t RouterScratchBytes(int64_t tokens, int num_experts) {
  const int64_t blocks = (tokens + kLossChunk - 1) / kLossChunk;
  return AlignUp(tokens * sizeof(float)) + AlignUp(blocks * (num_experts + 1) * sizeof(double));
}

int LaunchRouterForward(const RouterParams& p, const float* logits, const float* expert_bias,
                        int32_t* topk_expert, float* topk_weight, float* scores,
                        float* logsumexp, int32_t* expert_counts, double* loss_partials,
                        void* scratch, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int E = p.num_experts;
  if (static_cast<size_t>(3) * E * 4 > 48 * 1024) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(expert_counts, 0, E * sizeof(int32_t), s);
  if (err != cudaSuccess) return err;
  float* score_sum = static_cast<float*>(scratch);
  double* partial = reinterpret_cast<double*>(static_cast<char*>(scratch) +
                                              AlignUp(p.tokens * sizeof(float)));
  const int blocks_loss = static_cast<int>((p.tokens + kLossChunk - 1) / kLossChunk);
  if (p.tokens > 0) {
    const int warps = WarpsPerBlock(E, 3);
    const int64_t grid = (p.tokens + warps - 1) / warps;
    RouterForwardKernel<<<grid, warps * kWarp, warps * 3 * E * sizeof(float), s>>>(
        p, logits, expert_bias, topk_expert, topk_weight, scores, logsumexp, expert_counts,
        score_sum);
    LossPartialsKernel<<<blocks_loss, 128, 0, s>>>(p.tokens, E, p.sigmoid, scores, logsumexp,
                                                  score_sum, partial);
  }
  LossFinalKernel<<<(E + 256) / 256, 256, 0, s>>>(blocks_loss, E, partial, loss_partials);
  return cudaGetLastError();
}

int LaunchRouterBackward(const RouterParams& p, const float* logits, const float* scores,
                         const float* logsumexp, const int32_t* topk_expert,
                         const float* d_topk_weight, const float* aux_grad,
                         float z_loss_grad_scale, float* d_logits, void* stream) {
  if (p.tokens == 0) return cudaSuccess;
  const int E = p.num_experts;
  if (static_cast<size_t>(2) * E * 4 > 48 * 1024) return cudaErrorInvalidValue;
  const int warps = WarpsPerBlock(E, 2);
  const int64_t grid = (p.tokens + warps - 1) / warps;
  RouterBackwardKernel<<<grid, warps * kWarp, warps * 2 * E * sizeof(float),
                         static_cast<cudaStream_t>(stream)>>>(
      p, logits, scores, logsumexp, topk_expert, d_topk_weight, aux_grad, z_loss_grad_scale,
      d_logits);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace moe
