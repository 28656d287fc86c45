// MoeLayer backward (docs/SPEC.md "Backward"), written once against the Backend and
// Communicator seams: Backward is the list of its stages, each a method documented in
// moe_layer_impl.h. The only host round trip is the d_x copy. Parameter gradients are added to
// the layer's accumulated gradients (written outright while lazily zero, see LayerParam).
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/moe_layer_impl.h"
#include "engine/status_macros.h"

namespace moe {

absl::StatusOr<Tensor> MoeLayerImpl::Backward(StepContext& context, const Tensor& d_out,
                                              double d_aux, double d_z_loss, Tensor* d_x_into) {
  SavedStep* s = dynamic_cast<SavedStep*>(&context);
  if (s == nullptr || s->layer != this) {
    return absl::InvalidArgumentError("Backward: the step context belongs to another layer");
  }
  if (s->used) {
    return absl::FailedPreconditionError(
        "Backward: this step context was already used by a backward");
  }
  const int64_t T = s->tokens, H = config_.hidden;
  RETURN_IF_ERROR(CheckActivations("d_out", d_out, H));
  if (d_out.dim(0) != T) {
    return absl::InvalidArgumentError(absl::StrCat("d_out: expected shape [", T, ", ", H,
                                                   "] (the forward's), got ", d_out.ShapeString()));
  }
  if (!std::isfinite(d_aux) || !std::isfinite(d_z_loss)) {
    return absl::InvalidArgumentError("Backward: d_aux and d_z_loss must be finite");
  }
  RETURN_IF_ERROR(CheckOutputDestination("d_x", d_x_into, s->x_type, {T, H}));
  s->used = true;

  BackwardWork w;
  RETURN_IF_ERROR(CombineBackward(*s, d_out, w));           // 1
  RETURN_IF_ERROR(DispatchExpertsBackward(*s, w));          // 2-3
  RETURN_IF_ERROR(ReturnExpertGradients(*s, w));            // 4
  RETURN_IF_ERROR(RouterBackward(*s, d_aux, d_z_loss, w));  // 5
  RETURN_IF_ERROR(GateBackward(*s, w));                     // 6
  ASSIGN_OR_RETURN(Tensor result, DownloadInputGradient(*s, w, d_x_into));
  // The saved activations are no longer needed.
  *s = SavedStep{};
  s->used = true;
  s->layer = this;
  return result;
}

absl::Status MoeLayerImpl::CombineBackward(const SavedStep& s, const Tensor& d_out,
                                           BackwardWork& w) {
  const int64_t T = s.tokens, H = config_.hidden, K = config_.top_k;
  const DType cd = ExpertRowDType(config_);
  // 1. Combine backward: d_y in the local layout and d_probs.
  ASSIGN_OR_RETURN(Buffer d_out_dev, Upload(d_out.raw(), d_out.num_bytes()));
  ASSIGN_OR_RETURN(w.d_y_local, backend_->Allocate(s.plan.local_rows * H * DTypeSize(cd)));
  ASSIGN_OR_RETURN(w.d_probs, backend_->Allocate(T * K * sizeof(float)));
  return backend_->CombineBackward(d_out_dev.data(), d_out.dtype(), s.y_local.data(), cd,
                                   s.pair_row.as<int32_t>(), s.topk_weight.as<float>(), T, K, H,
                                   s.plan.local_rows, w.d_y_local.data(), w.d_probs.as<float>());
}

absl::Status MoeLayerImpl::DispatchExpertsBackward(SavedStep& s, BackwardWork& w) {
  const size_t row_bytes = config_.hidden * DTypeSize(ExpertRowDType(config_));
  const DispatchPlan& plan = s.plan;
  // 2. Dispatch d_y exactly as the forward dispatched x (one rank: d_y_local already is).
  const bool identity = DispatchIsIdentity(plan);
  Buffer d_y_expert;
  if (!identity) {
    ASSIGN_OR_RETURN(d_y_expert, backend_->Allocate(plan.expert_rows * row_bytes));
    RETURN_IF_ERROR(
        DispatchRows(backend_, comm_, plan, w.d_y_local.data(), d_y_expert.data(), row_bytes));
  }
  // 3. Expert FFN backward.
  ASSIGN_OR_RETURN(w.d_x_expert, backend_->Allocate(plan.expert_rows * row_bytes));
  return ExpertsBackward(s, identity ? w.d_y_local : d_y_expert, w.d_x_expert.data());
}

absl::Status MoeLayerImpl::ReturnExpertGradients(const SavedStep& s, BackwardWork& w) {
  const int64_t T = s.tokens, H = config_.hidden, K = config_.top_k;
  const DType cd = ExpertRowDType(config_);
  const DispatchPlan& plan = s.plan;
  // 4. Reverse exchange into the local layout (reusing d_y_local; one rank: d_x_expert already
  // is that layout), then d_x_t = sum_j d_X_(t,j).
  const bool identity = DispatchIsIdentity(plan);
  if (!identity) {
    RETURN_IF_ERROR(ReturnRows(backend_, comm_, plan, w.d_x_expert.data(), w.d_y_local.data(),
                               H * DTypeSize(cd)));
    w.d_x_expert.Reset();
  }
  const void* d_x_local = identity ? w.d_x_expert.data() : w.d_y_local.data();
  ASSIGN_OR_RETURN(w.d_x, backend_->Allocate(T * H * sizeof(float)));
  RETURN_IF_ERROR(backend_->CombineRows(d_x_local, cd, s.pair_row.as<int32_t>(), nullptr, T, K, H,
                                        w.d_x.data(), DType::kFloat32));
  w.d_y_local.Reset();
  w.d_x_expert.Reset();
  return absl::OkStatus();
}

absl::Status MoeLayerImpl::RouterBackward(const SavedStep& s, double d_aux, double d_z_loss,
                                          BackwardWork& w) {
  const LayerConfig& c = config_;
  const int64_t T = s.tokens, E = c.num_experts, K = c.top_k;
  // 5. Router backward.
  const double Tg = s.global_tokens;
  // dL/dP[t, e] = C * f_e * d_aux. The host copy outlives the upload (asynchronous backends).
  w.aux_grad_host.assign(E, 0.0f);
  if (c.aux_loss_coeff > 0 && Tg > 0) {
    const double coeff = E * c.aux_loss_coeff / (K * Tg * Tg);
    for (int64_t e = 0; e < E; ++e) {
      w.aux_grad_host[e] =
          static_cast<float>(coeff * static_cast<double>(s.global_counts[e]) * d_aux);
    }
    ASSIGN_OR_RETURN(w.aux_grad, Upload(w.aux_grad_host.data(), E * sizeof(float)));
  }
  ASSIGN_OR_RETURN(w.d_logits, backend_->Allocate(T * E * sizeof(float)));
  RouterBackwardArgs r;
  r.config = &c;
  r.tokens = T;
  r.logits = s.logits.as<float>();
  r.scores = s.scores.as<float>();
  r.logsumexp = s.logsumexp.as<float>();
  r.topk_expert = s.topk_expert.as<int32_t>();
  r.d_topk_weight = w.d_probs.as<float>();
  r.aux_grad = w.aux_grad.data() != nullptr ? w.aux_grad.as<float>() : nullptr;
  r.z_loss_grad_scale = c.z_loss_coeff > 0 && Tg > 0 ? d_z_loss * c.z_loss_coeff / Tg : 0.0;
  r.d_logits = w.d_logits.as<float>();
  return backend_->RouterBackward(r);
}

absl::Status MoeLayerImpl::GateBackward(const SavedStep& s, BackwardWork& w) {
  const int64_t T = s.tokens, H = config_.hidden, E = config_.num_experts;
  // 6. d_x += d_z . gate^T; d_gate += all-reduce(x^T . d_z).
  LayerParam& gate = *Find("gate");
  {
    GemmArgs g;
    g.trans_b = true;
    g.m = T, g.n = H, g.k = E;
    g.a = w.d_logits.data(), g.lda = E;
    g.b = gate.master.data(), g.ldb = E;
    g.c = w.d_x.data(), g.ldc = H;
    g.beta = 1.0f;
    RETURN_IF_ERROR(backend_->Gemm(g));
  }
  // This step's part goes straight into a lazily zero gradient (LayerParam), else into a scratch
  // buffer added after the all-reduce (which sums this step's parts only, never the history).
  Buffer d_gate_step;
  if (!gate.grad_zero) {
    ASSIGN_OR_RETURN(d_gate_step, backend_->Allocate(H * E * sizeof(float)));
  }
  float* d_gate = gate.grad_zero ? gate.grad.as<float>() : d_gate_step.as<float>();
  {
    GemmArgs g;
    g.trans_a = true;
    g.m = H, g.n = E, g.k = T;
    g.a = s.x32.data(), g.lda = H;
    g.a_bf16 = s.x16.data();
    g.b = w.d_logits.data(), g.ldb = E;
    g.c = d_gate, g.ldc = E;
    RETURN_IF_ERROR(backend_->Gemm(g));
  }
  RETURN_IF_ERROR(comm_->AllReduceSum(d_gate, H * E, DType::kFloat32));
  if (gate.grad_zero) {
    gate.grad_zero = false;
    return absl::OkStatus();
  }
  return backend_->AddInPlace(gate.grad.as<float>(), d_gate, H * E);
}

absl::StatusOr<Tensor> MoeLayerImpl::DownloadInputGradient(const SavedStep& s, BackwardWork& w,
                                                           Tensor* into) {
  const int64_t T = s.tokens, H = config_.hidden;
  if (s.x_type == DType::kFloat32) return DownloadInto(w.d_x, DType::kFloat32, {T, H}, into);
  ASSIGN_OR_RETURN(Buffer d_x_cast, backend_->Allocate(T * H * DTypeSize(s.x_type)));
  RETURN_IF_ERROR(
      backend_->Convert(w.d_x.data(), DType::kFloat32, d_x_cast.data(), s.x_type, T * H));
  return DownloadInto(d_x_cast, s.x_type, {T, H}, into);
}

}  // namespace moe
