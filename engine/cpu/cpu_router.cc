// Router forward and backward on the CPU (docs/SPEC.md Forward 1-6, Backward 5).
//
// Per-token work is independent and runs in parallel over token ranges, in double precision;
// the cross-token sums (expert counts, aux partials, z-loss numerator) are then taken
// serially in token order so the result never depends on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/parallel.h"

namespace moe {
namespace cpu {
namespace {

constexpr double kSigmoidEps = 1e-20;

double Sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// Orders expert indices by descending score, ties toward the lower index.
struct ByScore {
  const double* score;
  bool operator()(int a, int b) const {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  }
};

// Selects the k experts of one token into `selected` in slot order (descending selection
// score, ties toward the lower index), applying grouped top-k (DeepSeek-V3) when configured.
void SelectExperts(const LayerConfig& c, std::vector<double>& sel, std::vector<int>& order,
                   int32_t* selected) {
  const int E = static_cast<int>(c.num_experts);
  if (c.num_groups > 0 && c.group_topk > 0) {
    const int groups = static_cast<int>(c.num_groups);
    const int group_size = E / groups;
    const int per_group = static_cast<int>(c.top_k / c.group_topk);
    std::vector<double> group_score(groups);
    std::vector<double> tmp(group_size);
    for (int g = 0; g < groups; ++g) {
      std::copy(sel.begin() + g * group_size, sel.begin() + (g + 1) * group_size, tmp.begin());
      std::partial_sort(tmp.begin(), tmp.begin() + per_group, tmp.end(), std::greater<double>());
      double sum = 0;
      for (int i = 0; i < per_group; ++i) sum += tmp[i];
      group_score[g] = sum;
    }
    std::vector<int> group_order(groups);
    std::iota(group_order.begin(), group_order.end(), 0);
    std::partial_sort(group_order.begin(), group_order.begin() + c.group_topk, group_order.end(),
                      ByScore{group_score.data()});
    std::vector<char> keep(groups, 0);
    for (int i = 0; i < c.group_topk; ++i) keep[group_order[i]] = 1;
    for (int e = 0; e < E; ++e) {
      if (!keep[e / group_size]) sel[e] = -std::numeric_limits<double>::infinity();
    }
  }
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + c.top_k, order.end(), ByScore{sel.data()});
  for (int j = 0; j < c.top_k; ++j) selected[j] = order[j];
}

absl::Status CheckRouterConfig(const char* op, const LayerConfig* c, int64_t tokens) {
  if (c == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": null config"));
  if (tokens < 0) return absl::InvalidArgumentError(absl::StrCat(op, ": tokens < 0"));
  if (c->num_experts <= 0 || c->top_k <= 0 || c->top_k > c->num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": bad num_experts/top_k"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RouterForward(const RouterForwardArgs& a, int threads) {
  if (absl::Status s = CheckRouterConfig("RouterForward", a.config, a.tokens); !s.ok()) return s;
  const LayerConfig& c = *a.config;
  const int64_t T = a.tokens, E = c.num_experts, K = c.top_k;
  if (a.expert_counts == nullptr || a.loss_partials == nullptr ||
      (T > 0 && (a.logits == nullptr || a.topk_expert == nullptr || a.topk_weight == nullptr ||
                 a.scores == nullptr || a.logsumexp == nullptr))) {
    return absl::InvalidArgumentError("RouterForward: null buffer");
  }
  const bool sigmoid = c.score_function == ScoreFunction::kSigmoid;
  // Per token: the aux probability row P[t, :] (SPEC Forward 5), kept for the serial sums.
  std::vector<double> aux_p(static_cast<size_t>(T * E));
  std::vector<double> lse_all(static_cast<size_t>(T));
  ParallelFor(threads, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<double> z(E), s(E), sel(E);
    std::vector<int> order(E);
    for (int64_t t = begin; t < end; ++t) {
      const float* zt = a.logits + t * E;
      double zmax = -std::numeric_limits<double>::infinity();
      for (int64_t e = 0; e < E; ++e) {
        z[e] = zt[e];
        zmax = std::max(zmax, z[e]);
      }
      double sum_exp = 0;
      for (int64_t e = 0; e < E; ++e) sum_exp += std::exp(z[e] - zmax);
      const double lse = zmax + std::log(sum_exp);
      lse_all[t] = lse;
      a.logsumexp[t] = static_cast<float>(lse);
      double sig_sum = 0;
      for (int64_t e = 0; e < E; ++e) {
        s[e] = sigmoid ? Sigmoid(z[e]) : std::exp(z[e] - lse);
        a.scores[t * E + e] = static_cast<float>(s[e]);
        sig_sum += s[e];
      }
      for (int64_t e = 0; e < E; ++e) aux_p[t * E + e] = sigmoid ? s[e] / sig_sum : s[e];
      // Selection score. NaN (from NaN inputs) ranks lowest so that the ordering stays a
      // strict weak order and the selection deterministic; the outputs are NaN anyway.
      for (int64_t e = 0; e < E; ++e) {
        if (sigmoid) {
          sel[e] = s[e] + (a.expert_bias != nullptr ? static_cast<double>(a.expert_bias[e]) : 0.0);
        } else {
          sel[e] = c.pre_softmax ? s[e] : z[e];
        }
        if (std::isnan(sel[e])) sel[e] = -std::numeric_limits<double>::infinity();
      }
      int32_t* chosen = a.topk_expert + t * K;
      SelectExperts(c, sel, order, chosen);
      // Routing weights p on the selected set.
      float* w = a.topk_weight + t * K;
      if (sigmoid) {
        double sum_s = 0;
        for (int64_t j = 0; j < K; ++j) sum_s += s[chosen[j]];
        for (int64_t j = 0; j < K; ++j) {
          const double p = K > 1 ? s[chosen[j]] / (sum_s + kSigmoidEps) : s[chosen[j]];
          w[j] = static_cast<float>(c.scaling_factor * p);
        }
      } else if (c.pre_softmax) {
        for (int64_t j = 0; j < K; ++j) w[j] = static_cast<float>(c.scaling_factor * s[chosen[j]]);
      } else {
        // Slot 0 holds the largest selected logit: subtract it for a stable softmax over S.
        const double zs_max = z[chosen[0]];
        double sum_s = 0;
        for (int64_t j = 0; j < K; ++j) sum_s += std::exp(z[chosen[j]] - zs_max);
        for (int64_t j = 0; j < K; ++j) {
          w[j] = static_cast<float>(c.scaling_factor * std::exp(z[chosen[j]] - zs_max) / sum_s);
        }
      }
    }
  });
  // Serial sums in token order.
  for (int64_t e = 0; e < E; ++e) a.expert_counts[e] = 0;
  for (int64_t e = 0; e <= E; ++e) a.loss_partials[e] = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) ++a.expert_counts[a.topk_expert[t * K + j]];
    for (int64_t e = 0; e < E; ++e) a.loss_partials[e] += aux_p[t * E + e];
    a.loss_partials[E] += lse_all[t] * lse_all[t];
  }
  return absl::OkStatus();
}

absl::Status RouterBackward(const RouterBackwardArgs& a, int threads) {
  if (absl::Status s = CheckRouterConfig("RouterBackward", a.config, a.tokens); !s.ok()) {
    return s;
  }
  const LayerConfig& c = *a.config;
  const int64_t T = a.tokens, E = c.num_experts, K = c.top_k;
  if (T > 0 && (a.logits == nullptr || a.scores == nullptr || a.logsumexp == nullptr ||
                a.topk_expert == nullptr || a.d_topk_weight == nullptr || a.d_logits == nullptr)) {
    return absl::InvalidArgumentError("RouterBackward: null buffer");
  }
  const bool sigmoid = c.score_function == ScoreFunction::kSigmoid;
  ParallelFor(threads, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<double> g(E), dz(E), s(E);
    std::vector<char> in_s(E);
    for (int64_t t = begin; t < end; ++t) {
      const float* zt = a.logits + t * E;
      const int32_t* chosen = a.topk_expert + t * K;
      for (int64_t e = 0; e < E; ++e) {
        g[e] = 0;
        dz[e] = 0;
        in_s[e] = 0;
        s[e] = a.scores[t * E + e];
      }
      // 1. g_i = scaling_factor * d_probs_i on S.
      for (int64_t j = 0; j < K; ++j) {
        g[chosen[j]] = c.scaling_factor * static_cast<double>(a.d_topk_weight[t * K + j]);
        in_s[chosen[j]] = 1;
      }
      if (sigmoid) {
        // 2. Through the normalisation p_i = s_i / (sum_S s + eps) when k > 1.
        if (K > 1) {
          double sum_s = 0, dot = 0;
          for (int64_t j = 0; j < K; ++j) {
            sum_s += s[chosen[j]];
            dot += g[chosen[j]] * s[chosen[j]];
          }
          const double denom = sum_s + kSigmoidEps;
          for (int64_t j = 0; j < K; ++j) {
            const int e = chosen[j];
            g[e] = g[e] / denom - dot / (denom * denom);
          }
        }
        // 4. sigmoid: g_i * s_i (1 - s_i).
        for (int64_t e = 0; e < E; ++e) dz[e] = g[e] * s[e] * (1.0 - s[e]);
      } else if (c.pre_softmax) {
        // 4. Full softmax Jacobian: g_i <- s_i (g_i - sum_E g_j s_j).
        double dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += g[e] * s[e];
        for (int64_t e = 0; e < E; ++e) dz[e] = s[e] * (g[e] - dot);
      } else {
        // 3. Softmax over S: p_i recomputed from the logits; g_i <- p_i (g_i - sum_S g_j p_j).
        const double zs_max = zt[chosen[0]];
        double sum_s = 0;
        for (int64_t j = 0; j < K; ++j) sum_s += std::exp(zt[chosen[j]] - zs_max);
        double dot = 0;
        std::vector<double> p(K);
        for (int64_t j = 0; j < K; ++j) {
          p[j] = std::exp(zt[chosen[j]] - zs_max) / sum_s;
          dot += g[chosen[j]] * p[j];
        }
        for (int64_t j = 0; j < K; ++j) dz[chosen[j]] = p[j] * (g[chosen[j]] - dot);
      }
      // 5. Aux loss: dP[e] = aux_grad[e] through P = softmax(z) or sigma(z) / sum sigma(z).
      if (a.aux_grad != nullptr) {
        if (sigmoid) {
          double q = 0, dot = 0;
          for (int64_t e = 0; e < E; ++e) {
            q += s[e];
            dot += static_cast<double>(a.aux_grad[e]) * s[e];
          }
          for (int64_t e = 0; e < E; ++e) {
            const double d_sig = a.aux_grad[e] / q - dot / (q * q);
            dz[e] += d_sig * s[e] * (1.0 - s[e]);
          }
        } else {
          double dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += static_cast<double>(a.aux_grad[e]) * s[e];
          for (int64_t e = 0; e < E; ++e) dz[e] += s[e] * (a.aux_grad[e] - dot);
        }
      }
      // 6. z-loss: scale * 2 * lse * softmax(z).
      if (a.z_loss_grad_scale != 0.0) {
        const double lse = a.logsumexp[t];
        for (int64_t e = 0; e < E; ++e) {
          dz[e] += a.z_loss_grad_scale * 2.0 * lse * std::exp(zt[e] - lse);
        }
      }
      for (int64_t e = 0; e < E; ++e) a.d_logits[t * E + e] = static_cast<float>(dz[e]);
    }
  });
  return absl::OkStatus();
}

}  // namespace cpu
}  // namespace moe
