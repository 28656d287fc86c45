// Central finite differences over every input of the reference forward.
#include "tests/reference/finite_difference.h"

#include <cmath>
#include <sstream>

namespace moe_ref {

double RefLoss(const RefConfig& config, const RefParams& params, const std::vector<double>& x,
               int64_t tokens, const std::vector<double>& w_out, double d_aux, double d_zl,
               RefForwardResult* fwd_out) {
  RefForwardResult fwd = RefForward(config, params, x, tokens);
  double loss = d_aux * fwd.aux_loss + d_zl * fwd.z_loss;
  for (size_t i = 0; i < fwd.out.size(); ++i) loss += fwd.out[i] * w_out[i];
  if (fwd_out != nullptr) *fwd_out = std::move(fwd);
  return loss;
}

FdResult FiniteDifferenceGradients(const RefConfig& config, const RefParams& params,
                                   const std::vector<double>& x, int64_t tokens,
                                   const std::vector<double>& w_out, double d_aux, double d_zl,
                                   double step) {
  RefForwardResult base;
  RefLoss(config, params, x, tokens, w_out, d_aux, d_zl, &base);

  FdResult result;
  RefParams p = params;
  std::vector<double> xx = x;
  // Differentiates L along one element (pointer into p or xx), restoring it afterwards.
  auto derivative = [&](double* element, const char* name, size_t index) {
    const double saved = *element;
    RefForwardResult fwd;
    *element = saved + step;
    const double plus = RefLoss(config, p, xx, tokens, w_out, d_aux, d_zl, &fwd);
    bool same = fwd.routing.SameDecisions(base.routing);
    *element = saved - step;
    const double minus = RefLoss(config, p, xx, tokens, w_out, d_aux, d_zl, &fwd);
    same = same && fwd.routing.SameDecisions(base.routing);
    *element = saved;
    if (!same && !result.routing_changed) {
      result.routing_changed = true;
      std::ostringstream os;
      os << "perturbing " << name << "[" << index << "] by " << step << " changes the routing";
      result.detail = os.str();
    }
    return (plus - minus) / (2.0 * step);
  };
  auto all = [&](std::vector<double>* values, const char* name) {
    std::vector<double> grad(values->size(), 0.0);
    for (size_t i = 0; i < values->size(); ++i) grad[i] = derivative(&(*values)[i], name, i);
    return grad;
  };
  result.grads.d_x = all(&xx, "x");
  result.grads.d_gate = all(&p.gate, "gate");
  result.grads.d_wi = all(&p.wi, "wi");
  result.grads.d_wo = all(&p.wo, "wo");
  if (config.use_bias) {
    result.grads.d_wi_bias = all(&p.wi_bias, "wi_bias");
    result.grads.d_wo_bias = all(&p.wo_bias, "wo_bias");
  } else {
    result.grads.d_wi_bias.assign(p.wi_bias.size(), 0.0);
    result.grads.d_wo_bias.assign(p.wo_bias.size(), 0.0);
  }
  return result;
}

double RelativeError(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0.0, norm = 0.0, norm_a = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
    norm_a += a[i] * a[i];
  }
  if (norm == 0.0) return std::sqrt(norm_a);
  return std::sqrt(diff / norm);
}

}  // namespace moe_ref
