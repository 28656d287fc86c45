// The expert FFN of the local experts on the expert layout, both ways (docs/SPEC.md Forward 10,
// Backward 3): per-expert GEMMs (one GroupedGemm call per projection), the activation and the
// biases. GEMMs accumulate in fp32; weight gradients are fp32 and accumulate across backwards.
// Under FP8 (docs/SPEC.md "FP8") the four activation GEMMs (h, y, d_a, d_X) run on quantised
// operands (Fp8ExpertGemm) and the rows are stored in bf16; the weight-gradient GEMMs read the
// bf16 rows.
#include "engine/moe_layer_impl.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

// The FP8 format of the gradient rows (d_y, d_h) in the backward's data-gradient GEMMs: e4m3
// like everything else (docs/SPEC.md "FP8" says why not e5m2).
constexpr DType kGradientFp8 = DType::kFloat8E4M3;

// Under FP8 the codes of a quantised GEMM input follow its scale at this offset (16-byte
// aligned operands for the tensor cores).
constexpr size_t kFp8CodesOffset = 256;

// Per local expert GEMMs over the expert layout: rows [offset, offset + group_rows[el]).
template <typename MakeGemm>
absl::Status PerExpert(Backend* backend, const std::vector<int64_t>& group_rows,
                       const MakeGemm& make) {
  std::vector<GemmArgs> gemms;
  int64_t offset = 0;
  for (size_t el = 0; el < group_rows.size(); ++el) {
    gemms.push_back(make(static_cast<int64_t>(el), offset, group_rows[el]));
    offset += group_rows[el];
  }
  return backend->GroupedGemm(gemms);
}

}  // namespace

absl::Status MoeLayerImpl::Fp8ExpertGemm(const std::vector<int64_t>& group_rows, const void* in,
                                         DType in_fp8, int64_t k, const void* weights,
                                         const float* weight_scales, int64_t n, void* out) {
  const DType rd = ExpertRowDType(config_);
  int64_t rows = 0;
  for (int64_t r : group_rows) rows += r;
  if (rows == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(Buffer quantised, backend_->Allocate(kFp8CodesOffset + rows * k));
  const float* in_scale = quantised.as<float>();
  const uint8_t* codes = quantised.as<uint8_t>() + kFp8CodesOffset;
  QuantizeArgs q;
  q.src = in, q.src_type = rd, q.rows = rows, q.cols = k, q.fp8 = in_fp8;
  q.dst = quantised.as<uint8_t>() + kFp8CodesOffset, q.scale = quantised.as<float>();
  RETURN_IF_ERROR(backend_->QuantizeFp8(q));
  return PerExpert(backend_, group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.trans_b = true;
    g.m = m, g.n = n, g.k = k;
    g.a = codes + off * k, g.lda = k;
    g.b = static_cast<const uint8_t*>(weights) + el * n * k, g.ldb = k;
    g.c = static_cast<char*>(out) + off * n * DTypeSize(rd), g.ldc = n;
    g.c_type = rd;
    g.a_fp8 = in_fp8, g.b_fp8 = DType::kFloat8E4M3;
    g.a_scale = in_scale, g.b_scale = weight_scales + el * kFp8ScaleStride;
    return g;
  });
}

absl::Status MoeLayerImpl::ExpertDataGemm(const std::vector<int64_t>& group_rows, const void* in,
                                          int64_t k, const LayerParam& w, bool transposed,
                                          DType in_fp8, int64_t n, void* out) {
  if (config_.compute_dtype == DType::kFloat8E4M3) {
    return Fp8ExpertGemm(group_rows, in, in_fp8, k,
                         transposed ? w.compute.data() : w.compute_t.data(),
                         w.compute_scale.as<float>(), n, out);
  }
  const DType cd = ExpertRowDType(config_);
  const size_t cs = DTypeSize(cd);
  const char* weights = static_cast<const char*>(ComputeWeights(w));
  return PerExpert(backend_, group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.trans_b = transposed;
    g.m = m, g.n = n, g.k = k;
    g.a = static_cast<const char*>(in) + off * k * cs, g.lda = k;
    g.b = weights + el * k * n * cs, g.ldb = transposed ? k : n;
    g.c = static_cast<char*>(out) + off * n * cs, g.ldc = n;
    g.ab_type = cd, g.c_type = cd;
    return g;
  });
}

absl::Status MoeLayerImpl::ExpertsForward(SavedStep& s, ForwardWork& w) {
  const LayerConfig& c = config_;
  const DType cd = ExpertRowDType(c);
  const size_t cs = DTypeSize(cd);
  const int64_t H = c.hidden, F = c.ffn, up = UpWidth(c);
  const DispatchPlan& plan = s.plan;
  ASSIGN_OR_RETURN(s.h, backend_->Allocate(plan.expert_rows * up * cs));
  ASSIGN_OR_RETURN(s.act, backend_->Allocate(plan.expert_rows * F * cs));
  ASSIGN_OR_RETURN(w.y_expert, backend_->Allocate(plan.expert_rows * H * cs));
  void* h = s.h.data();
  void* act = s.act.data();
  void* y = w.y_expert.data();
  // h = X_e . wi_e   ([rows, H] x [H, up])
  RETURN_IF_ERROR(ExpertDataGemm(plan.group_rows, s.x_expert.data(), H, *Find("wi"),
                                 /*transposed=*/false, DType::kFloat8E4M3, up, h));
  ActivationArgs aa;
  aa.activation = c.activation, aa.gated = c.gated, aa.rows = plan.expert_rows, aa.ffn = F;
  aa.dtype = cd, aa.h = h, aa.a = act;
  aa.up_bias = c.use_bias ? Find("wi_bias")->master.as<float>() : nullptr;
  aa.group_rows = plan.group_rows;
  RETURN_IF_ERROR(backend_->ActivationForward(aa));
  // y = a . wo_e   ([rows, F] x [F, H])
  RETURN_IF_ERROR(ExpertDataGemm(plan.group_rows, act, F, *Find("wo"), /*transposed=*/false,
                                 DType::kFloat8E4M3, H, y));
  if (c.use_bias) {
    RETURN_IF_ERROR(
        backend_->AddGroupBias(y, cd, Find("wo_bias")->master.as<float>(), H, plan.group_rows));
  }
  return absl::OkStatus();
}

absl::Status MoeLayerImpl::ExpertsBackward(const SavedStep& s, const void* d_y, void* d_x_expert) {
  const LayerConfig& c = config_;
  const DType cd = ExpertRowDType(c);
  const size_t cs = DTypeSize(cd);
  const int64_t H = c.hidden, F = c.ffn, up = UpWidth(c);
  const DispatchPlan& plan = s.plan;
  LayerParam& wi = *Find("wi");
  LayerParam& wo = *Find("wo");
  const char* dy = static_cast<const char*>(d_y);
  ASSIGN_OR_RETURN(Buffer d_act, backend_->Allocate(plan.expert_rows * F * cs));
  // d_a = d_y . wo_e^T   ([rows, H] x [H, F]; wo_e stored [F, H]); FP8: d_y quantised.
  RETURN_IF_ERROR(ExpertDataGemm(plan.group_rows, d_y, H, wo, /*transposed=*/true, kGradientFp8, F,
                                 d_act.data()));
  // d_wo_e += a^T . d_y   ([F, rows] x [rows, H]), fp32 gradient; written (beta = 0) when it is
  // lazily zero (LayerParam), which covers every expert's slice, k = 0 ones included.
  const float wo_beta = wo.grad_zero ? 0.0f : 1.0f;
  RETURN_IF_ERROR(PerExpert(backend_, plan.group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.trans_a = true;
    g.m = F, g.n = H, g.k = m;
    g.a = s.act.as<char>() + off * F * cs, g.lda = F;
    g.b = dy + off * H * cs, g.ldb = H;
    g.c = wo.grad.as<float>() + el * F * H, g.ldc = H;
    g.ab_type = cd, g.c_type = DType::kFloat32, g.beta = wo_beta;
    return g;
  }));
  wo.grad_zero = false;
  if (c.use_bias) {
    LayerParam& wo_bias = *Find("wo_bias");
    RETURN_IF_ERROR(MaterializeGradient(wo_bias));
    RETURN_IF_ERROR(backend_->GroupBiasGrad(d_y, cd, H, plan.group_rows, wo_bias.grad.as<float>()));
  }
  ASSIGN_OR_RETURN(Buffer d_h, backend_->Allocate(plan.expert_rows * up * cs));
  ActivationArgs aa;
  aa.activation = c.activation, aa.gated = c.gated, aa.rows = plan.expert_rows, aa.ffn = F;
  aa.dtype = cd, aa.h = s.h.data(), aa.d_a = d_act.data(), aa.d_h = d_h.data();
  aa.group_rows = plan.group_rows;
  RETURN_IF_ERROR(backend_->ActivationBackward(aa));
  d_act.Reset();
  // d_wi_e += X_e^T . d_h   ([H, rows] x [rows, up]); written when lazily zero, as d_wo.
  const float wi_beta = wi.grad_zero ? 0.0f : 1.0f;
  RETURN_IF_ERROR(PerExpert(backend_, plan.group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.trans_a = true;
    g.m = H, g.n = up, g.k = m;
    g.a = s.x_expert.as<char>() + off * H * cs, g.lda = H;
    g.b = d_h.as<char>() + off * up * cs, g.ldb = up;
    g.c = wi.grad.as<float>() + el * H * up, g.ldc = up;
    g.ab_type = cd, g.c_type = DType::kFloat32, g.beta = wi_beta;
    return g;
  }));
  wi.grad_zero = false;
  if (c.use_bias) {
    LayerParam& wi_bias = *Find("wi_bias");
    RETURN_IF_ERROR(MaterializeGradient(wi_bias));
    RETURN_IF_ERROR(
        backend_->GroupBiasGrad(d_h.data(), cd, up, plan.group_rows, wi_bias.grad.as<float>()));
  }
  // d_X_e = d_h . wi_e^T   ([rows, up] x [up, H]; wi_e stored [H, up]); FP8: d_h quantised.
  return ExpertDataGemm(plan.group_rows, d_h.data(), up, wi, /*transposed=*/true, kGradientFp8, H,
                        d_x_expert);
}

}  // namespace moe
