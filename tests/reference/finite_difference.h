// Central finite differences of the reference forward (double precision), for checking
// analytic gradients: the reference's own and the engine's.
//
//   FdResult fd = FiniteDifferenceGradients(config, params, x, tokens, w_out, 1.0, 1.0);
//   ASSERT_FALSE(fd.routing_changed) << fd.detail;
//   EXPECT_LT(RelativeError(engine_d_wi, fd.grads.d_wi), 1e-4);
//
// The scalar loss is L = sum(out * w_out) + d_aux * aux + d_zl * z_loss, so its gradient is the
// backward with d_out = w_out. A perturbation that changes a routing decision (selected set or
// capacity drop) makes L non-differentiable there: such points are reported, not hidden.
#ifndef MOED_TESTS_REFERENCE_FINITE_DIFFERENCE_H_
#define MOED_TESTS_REFERENCE_FINITE_DIFFERENCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tests/reference/reference_moe.h"

namespace moe_ref {

// L at (params, x); fills *fwd_out when non-null.
double RefLoss(const RefConfig& config, const RefParams& params, const std::vector<double>& x,
               int64_t tokens, const std::vector<double>& w_out, double d_aux, double d_zl,
               RefForwardResult* fwd_out = nullptr);

struct FdResult {
  RefGradients grads;            // same layout as RefBackward's
  bool routing_changed = false;  // a perturbed forward routed differently
  std::string detail;            // which element, when routing_changed
};

// dL/d(every element of x, gate, wi, wo and, with use_bias, wi_bias, wo_bias) by central
// differences with the given step.
FdResult FiniteDifferenceGradients(const RefConfig& config, const RefParams& params,
                                   const std::vector<double>& x, int64_t tokens,
                                   const std::vector<double>& w_out, double d_aux, double d_zl,
                                   double step = 1e-5);

// ||a - b|| / ||b|| (||a|| when b is all zero); a and b must have the same length.
double RelativeError(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace moe_ref

#endif  // MOED_TESTS_REFERENCE_FINITE_DIFFERENCE_H_
