// The reference forward and backward (docs/SPEC.md Forward 1, 5, 6, 10, 11 and Backward), dense and
// per token, in double precision. Routing lives in reference_router.cc.
#include "tests/reference/reference_moe.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace moe_ref {
namespace {

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;

double Sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

double LogSumExp(const double* z, int64_t n) {
  double mx = *std::max_element(z, z + n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(z[i] - mx);
  return mx + std::log(sum);
}

// The aux-loss probability P[t, :] of SPEC Forward 5: softmax(z) or sigmoid(z) / sum sigmoid(z).
void AuxProbabilities(const RefConfig& c, const double* z, double* out) {
  const int64_t E = c.num_experts;
  if (c.score == RefScore::kSoftmax) {
    double lse = LogSumExp(z, E);
    for (int64_t e = 0; e < E; ++e) out[e] = std::exp(z[e] - lse);
  } else {
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += Sigmoid(z[e]);
    for (int64_t e = 0; e < E; ++e) out[e] = Sigmoid(z[e]) / sum;
  }
}

double AuxScale(const RefConfig& c, int64_t tokens) {
  return static_cast<double>(c.num_experts) * c.aux_loss_coeff /
         (static_cast<double>(c.top_k) * static_cast<double>(tokens) * tokens);
}

}  // namespace

std::string RefConfig::ToString() const {
  std::ostringstream os;
  os << "H=" << hidden << " F=" << ffn << " E=" << num_experts << " k=" << top_k
     << " score=" << (score == RefScore::kSoftmax ? "softmax" : "sigmoid")
     << " pre_softmax=" << pre_softmax << " groups=" << num_groups << "/" << group_topk
     << " scaling=" << scaling_factor << " expert_bias=" << use_expert_bias
     << " aux=" << aux_loss_coeff << " zl=" << z_loss_coeff << " cf=" << capacity_factor
     << " act=" << static_cast<int>(activation) << " gated=" << gated << " bias=" << use_bias;
  return os.str();
}

RefParams RefParams::Zeros(const RefConfig& c) {
  const int64_t H = c.hidden, F = c.ffn, E = c.num_experts, up = c.up();
  RefParams p;
  p.gate.assign(H * E, 0.0);
  p.expert_bias.assign(E, 0.0);
  p.wi.assign(E * H * up, 0.0);
  p.wo.assign(E * F * H, 0.0);
  p.wi_bias.assign(E * up, 0.0);
  p.wo_bias.assign(E * H, 0.0);
  return p;
}

double RefAct(RefActivation act, double v) {
  switch (act) {
    case RefActivation::kSilu:
      return v * Sigmoid(v);
    case RefActivation::kGelu:
      return 0.5 * v * (1.0 + std::tanh(kGeluC * (v + kGeluA * v * v * v)));
    case RefActivation::kRelu:
      return v > 0.0 ? v : 0.0;
    case RefActivation::kLinear:
      return v;
  }
  return 0.0;
}

double RefActGrad(RefActivation act, double v) {
  switch (act) {
    case RefActivation::kSilu: {
      double sg = Sigmoid(v);
      return sg * (1.0 + v * (1.0 - sg));
    }
    case RefActivation::kGelu: {
      double inner = kGeluC * (v + kGeluA * v * v * v);
      double th = std::tanh(inner);
      double d_inner = kGeluC * (1.0 + 3.0 * kGeluA * v * v);
      return 0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * d_inner;
    }
    case RefActivation::kRelu:
      return v > 0.0 ? 1.0 : 0.0;
    case RefActivation::kLinear:
      return 1.0;
  }
  return 0.0;
}

RefForwardResult RefForward(const RefConfig& c, const RefParams& params,
                            const std::vector<double>& x, int64_t tokens) {
  const int64_t H = c.hidden, F = c.ffn, E = c.num_experts, k = c.top_k, up = c.up();
  RefForwardResult r;
  r.tokens = tokens;
  r.logits.assign(tokens * E, 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0.0;
      for (int64_t i = 0; i < H; ++i) acc += x[t * H + i] * params.gate[i * E + e];
      r.logits[t * E + e] = acc;
    }
  }
  r.routing = RefRoute(c, params, r.logits, tokens);

  r.tokens_per_expert.assign(E, 0);
  r.pair_expert.assign(tokens * k, -1);
  r.h.assign(tokens * k * up, 0.0);
  r.y.assign(tokens * k * H, 0.0);
  r.out.assign(tokens * H, 0.0);
  std::vector<double> a(F);
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t j = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (!r.routing.selected[t * E + e]) continue;
      ++r.tokens_per_expert[e];
      r.pair_expert[t * k + j] = static_cast<int32_t>(e);
      if (r.routing.kept[t * E + e]) {
        double* h = &r.h[(t * k + j) * up];
        double* y = &r.y[(t * k + j) * H];
        for (int64_t o = 0; o < up; ++o) {
          double acc = c.use_bias ? params.wi_bias[e * up + o] : 0.0;
          for (int64_t i = 0; i < H; ++i) acc += x[t * H + i] * params.wi[(e * H + i) * up + o];
          h[o] = acc;
        }
        for (int64_t f = 0; f < F; ++f) {
          a[f] = c.gated ? RefAct(c.activation, h[f]) * h[F + f] : RefAct(c.activation, h[f]);
        }
        const double prob = r.routing.probs[t * E + e];
        for (int64_t o = 0; o < H; ++o) {
          double acc = c.use_bias ? params.wo_bias[e * H + o] : 0.0;
          for (int64_t f = 0; f < F; ++f) acc += a[f] * params.wo[(e * F + f) * H + o];
          y[o] = acc;
          r.out[t * H + o] += prob * acc;
        }
      }
      ++j;
    }
  }

  if (tokens > 0 && c.aux_loss_coeff > 0.0) {
    std::vector<double> sum_p(E, 0.0), prob(E);
    for (int64_t t = 0; t < tokens; ++t) {
      AuxProbabilities(c, &r.logits[t * E], prob.data());
      for (int64_t e = 0; e < E; ++e) sum_p[e] += prob[e];
    }
    double acc = 0.0;
    for (int64_t e = 0; e < E; ++e) acc += sum_p[e] * static_cast<double>(r.tokens_per_expert[e]);
    r.aux_loss = AuxScale(c, tokens) * acc;
  }
  if (tokens > 0 && c.z_loss_coeff > 0.0) {
    double acc = 0.0;
    for (int64_t t = 0; t < tokens; ++t) {
      double lse = LogSumExp(&r.logits[t * E], E);
      acc += lse * lse;
    }
    r.z_loss = c.z_loss_coeff / static_cast<double>(tokens) * acc;
  }
  return r;
}

RefGradients RefBackward(const RefConfig& c, const RefParams& params, const std::vector<double>& x,
                         const RefForwardResult& fwd, const std::vector<double>& d_out,
                         double d_aux, double d_zl) {
  const int64_t H = c.hidden, F = c.ffn, E = c.num_experts, k = c.top_k, up = c.up();
  const int64_t T = fwd.tokens;
  const RefRouting& rt = fwd.routing;
  RefGradients g;
  g.d_x.assign(T * H, 0.0);
  g.d_gate.assign(H * E, 0.0);
  g.d_wi.assign(E * H * up, 0.0);
  g.d_wo.assign(E * F * H, 0.0);
  g.d_wi_bias.assign(E * up, 0.0);
  g.d_wo_bias.assign(E * H, 0.0);

  std::vector<double> d_probs(T * E, 0.0);
  std::vector<double> a(F), d_y(H), d_a(F), d_h(up);
  // Combine and expert FFN, pair by pair. Dropped pairs take no part in the output, so
  // they have zero gradient everywhere (their routing weight included).
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = fwd.pair_expert[t * k + j];
      if (e < 0 || !rt.kept[t * E + e]) continue;
      const double* h = &fwd.h[(t * k + j) * up];
      const double* y = &fwd.y[(t * k + j) * H];
      const double prob = rt.probs[t * E + e];
      double dp = 0.0;
      for (int64_t o = 0; o < H; ++o) {
        dp += d_out[t * H + o] * y[o];
        d_y[o] = prob * d_out[t * H + o];
      }
      d_probs[t * E + e] = dp;
      for (int64_t f = 0; f < F; ++f) {
        a[f] = c.gated ? RefAct(c.activation, h[f]) * h[F + f] : RefAct(c.activation, h[f]);
      }
      for (int64_t f = 0; f < F; ++f) {
        double acc = 0.0;
        for (int64_t o = 0; o < H; ++o) {
          acc += d_y[o] * params.wo[(e * F + f) * H + o];
          g.d_wo[(e * F + f) * H + o] += a[f] * d_y[o];
        }
        d_a[f] = acc;
      }
      if (c.use_bias) {
        for (int64_t o = 0; o < H; ++o) g.d_wo_bias[e * H + o] += d_y[o];
      }
      for (int64_t f = 0; f < F; ++f) {
        if (c.gated) {
          d_h[F + f] = d_a[f] * RefAct(c.activation, h[f]);
          d_h[f] = d_a[f] * h[F + f] * RefActGrad(c.activation, h[f]);
        } else {
          d_h[f] = d_a[f] * RefActGrad(c.activation, h[f]);
        }
      }
      if (c.use_bias) {
        for (int64_t o = 0; o < up; ++o) g.d_wi_bias[e * up + o] += d_h[o];
      }
      for (int64_t i = 0; i < H; ++i) {
        double acc = 0.0;
        for (int64_t o = 0; o < up; ++o) {
          g.d_wi[(e * H + i) * up + o] += x[t * H + i] * d_h[o];
          acc += d_h[o] * params.wi[(e * H + i) * up + o];
        }
        g.d_x[t * H + i] += acc;
      }
    }
  }

  // Router: d_z from the routing weights, the aux loss and the z-loss.
  std::vector<double> d_z(T * E, 0.0), gw(E), aux_p(E), d_aux_p(E);
  const double aux_scale = T > 0 ? AuxScale(c, T) : 0.0;
  for (int64_t e = 0; e < E; ++e) {
    d_aux_p[e] = aux_scale * static_cast<double>(fwd.tokens_per_expert[e]) * d_aux;
  }
  for (int64_t t = 0; t < T; ++t) {
    const double* z = &fwd.logits[t * E];
    const double* s = &rt.scores[t * E];
    const double* p = &rt.p[t * E];
    const uint8_t* in_s = &rt.selected[t * E];
    double* dz = &d_z[t * E];
    // dL/dp on S (0 off S).
    for (int64_t e = 0; e < E; ++e) gw[e] = in_s[e] ? c.scaling_factor * d_probs[t * E + e] : 0.0;
    if (c.score == RefScore::kSoftmax && c.pre_softmax) {
      // p = softmax over all E restricted to S.
      double dot = 0.0;
      for (int64_t e = 0; e < E; ++e) dot += gw[e] * s[e];
      for (int64_t e = 0; e < E; ++e) dz[e] += s[e] * (gw[e] - dot);
    } else if (c.score == RefScore::kSoftmax) {
      // p = softmax over S of z.
      double dot = 0.0;
      for (int64_t e = 0; e < E; ++e) dot += gw[e] * p[e];
      for (int64_t e = 0; e < E; ++e) {
        if (in_s[e]) dz[e] += p[e] * (gw[e] - dot);
      }
    } else {
      // p = s / (sum_S s + eps) (k > 1) or s (k = 1); then s = sigmoid(z).
      std::vector<double> ds(gw);
      if (k > 1) {
        double sum = 0.0, dot = 0.0;
        for (int64_t e = 0; e < E; ++e) {
          if (in_s[e]) {
            sum += s[e];
            dot += gw[e] * s[e];
          }
        }
        const double denom = sum + 1e-20;
        for (int64_t e = 0; e < E; ++e) {
          ds[e] = in_s[e] ? gw[e] / denom - dot / (denom * denom) : 0.0;
        }
      }
      for (int64_t e = 0; e < E; ++e) dz[e] += ds[e] * s[e] * (1.0 - s[e]);
    }
    if (c.aux_loss_coeff > 0.0) {
      AuxProbabilities(c, z, aux_p.data());
      if (c.score == RefScore::kSoftmax) {
        double dot = 0.0;
        for (int64_t e = 0; e < E; ++e) dot += d_aux_p[e] * aux_p[e];
        for (int64_t e = 0; e < E; ++e) dz[e] += aux_p[e] * (d_aux_p[e] - dot);
      } else {
        double sum = 0.0, dot = 0.0;
        for (int64_t e = 0; e < E; ++e) {
          sum += Sigmoid(z[e]);
          dot += d_aux_p[e] * Sigmoid(z[e]);
        }
        for (int64_t e = 0; e < E; ++e) {
          const double sg = Sigmoid(z[e]);
          const double d_sig = d_aux_p[e] / sum - dot / (sum * sum);
          dz[e] += d_sig * sg * (1.0 - sg);
        }
      }
    }
    if (c.z_loss_coeff > 0.0) {
      const double lse = LogSumExp(z, E);
      const double scale = d_zl * c.z_loss_coeff / static_cast<double>(T) * 2.0 * lse;
      for (int64_t e = 0; e < E; ++e) dz[e] += scale * std::exp(z[e] - lse);
    }
  }
  // d_x += d_z gate^T; d_gate = x^T d_z.
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) {
      double acc = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        acc += d_z[t * E + e] * params.gate[i * E + e];
        g.d_gate[i * E + e] += x[t * H + i] * d_z[t * E + e];
      }
      g.d_x[t * H + i] += acc;
    }
  }
  return g;
}

}  // namespace moe_ref
