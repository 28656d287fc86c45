// The expert FFN of the local experts on the expert layout, both ways (docs/SPEC.md Forward 10,
// Backward 3): per-expert GEMMs (one GroupedGemm call per projection in the forward; in the
// backward one or two per phase: BackwardPhaseGemms), the activation and the biases. GEMMs
// accumulate in fp32; weight gradients are fp32 and accumulate across backwards. Under FP8
// (docs/SPEC.md "FP8") the GEMMs of the layer's fp8_gemms_ (engine/fp8_gemms.h) run on
// quantised operands: each input of such a GEMM is quantised once (QuantizeExpertRows) into the
// codes as stored (h, y, d_a, d_X: Fp8ExpertGemms) and/or grouped transposed (the weight
// gradients: ExpertWeightGradGemms), whichever its FP8 GEMMs read; the rows are stored in bf16,
// and the other GEMMs read them as the BF16 layer does.
#include <algorithm>
#include <vector>

#include "engine/moe_layer_impl.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

// The FP8 format of the gradient rows (d_y, d_h) in the backward's GEMMs: e4m3 like
// everything else (docs/SPEC.md "FP8" says why not e5m2).
constexpr DType kGradientFp8 = DType::kFloat8E4M3;

// Per local expert GEMMs over the expert layout: rows [offset, offset + group_rows[el]).
template <typename MakeGemm>
std::vector<GemmArgs> PerExpert(const std::vector<int64_t>& group_rows, const MakeGemm& make) {
  std::vector<GemmArgs> gemms;
  int64_t offset = 0;
  for (size_t el = 0; el < group_rows.size(); ++el) {
    gemms.push_back(make(static_cast<int64_t>(el), offset, group_rows[el]));
    offset += group_rows[el];
  }
  return gemms;
}

// One backward phase's GEMMs: the data gradient's (`data`) and the weight gradient's
// (`weight`), independent of each other (each writes its own output from inputs neither
// writes). While the weight gradients accumulate (beta = 1: their GEMMs read and write fp32
// gradients, memory-bound for many small experts) both go into one GroupedGemm, alternating,
// so that they run side by side and the gradient traffic hides behind the data gradient's
// math: dsv3's accumulating step 62.1 -> 58.8 ms on the H200. When the gradients are written
// (beta = 0) the two lists run one after the other: side by side was 1.5-2 % slower there
// (docs/PERFORMANCE.md). Each GEMM's result does not depend on what runs beside it.
absl::Status BackwardPhaseGemms(Backend* backend, const std::vector<GemmArgs>& data,
                                const std::vector<GemmArgs>& weight, bool accumulating) {
  if (!accumulating) {
    RETURN_IF_ERROR(backend->GroupedGemm(data));
    return backend->GroupedGemm(weight);
  }
  std::vector<GemmArgs> both;
  both.reserve(data.size() + weight.size());
  for (size_t i = 0; i < std::max(data.size(), weight.size()); ++i) {
    if (i < data.size()) both.push_back(data[i]);
    if (i < weight.size()) both.push_back(weight[i]);
  }
  return backend->GroupedGemm(both);
}

}  // namespace

absl::Status MoeLayerImpl::PrepareFp8(Fp8Tensor t, bool producer_amax, int64_t rows, Fp8Rows& q) {
  if (!q.quantised()) return absl::OkStatus();
  ASSIGN_OR_RETURN(q.scale, backend_->Allocate(kFp8ScaleStride * sizeof(float)));
  q.amax_from_producer = producer_amax;
  if (rows > 0) RETURN_IF_ERROR(fp8_history_.BeginStep(t, q.scale.as<float>() + 2, &q.history));
  // The producer reduces into a zeroed slot: the history's (zeroed by BeginStep) or scale[1].
  if (!producer_amax || q.history.amax != nullptr) return absl::OkStatus();
  return backend_->Memset(q.scale.data(), 0, kFp8ScaleStride * sizeof(float));
}

absl::Status MoeLayerImpl::QuantizeExpertRows(const std::vector<int64_t>& group_rows,
                                              const void* in, int64_t cols, Fp8Rows& q) {
  if (!q.quantised()) return absl::OkStatus();
  int64_t rows = 0;
  for (int64_t r : group_rows) rows += r;
  if (q.want_rows) {
    ASSIGN_OR_RETURN(q.rows, backend_->Allocate(rows * cols));
  }
  if (q.want_columns) {
    ASSIGN_OR_RETURN(q.columns, backend_->Allocate(cols * Fp8GroupedColumns(group_rows)));
  }
  QuantizeArgs a;
  a.src = in, a.src_type = ExpertRowDType(config_), a.rows = rows, a.cols = cols, a.fp8 = q.fp8;
  a.dst = q.rows.data(), a.scale = q.scale.as<float>(), a.amax = q.scale_amax();
  // Delayed: this step's amax for the history, unless the producer recorded it already.
  a.amax_out = q.amax_from_producer ? nullptr : q.history.amax;
  if (q.want_columns) a.dst_grouped_t = q.columns.data(), a.group_rows = group_rows;
  return backend_->QuantizeFp8(a);
}

std::vector<GemmArgs> MoeLayerImpl::Fp8ExpertGemms(const std::vector<int64_t>& group_rows,
                                                   const Fp8Rows& in, int64_t k,
                                                   const void* weights, const float* weight_scales,
                                                   int64_t n, void* out) const {
  const DType rd = ExpertRowDType(config_);
  const uint8_t* codes = in.rows.as<uint8_t>();
  int64_t rows = 0;
  for (int64_t r : group_rows) rows += r;
  if (rows == 0) return {};
  return PerExpert(group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.trans_b = true;
    g.m = m, g.n = n, g.k = k;
    g.a = codes + off * k, g.lda = k;
    g.b = static_cast<const uint8_t*>(weights) + el * n * k, g.ldb = k;
    g.c = static_cast<char*>(out) + off * n * DTypeSize(rd), g.ldc = n;
    g.c_type = rd;
    g.a_fp8 = in.fp8, g.b_fp8 = DType::kFloat8E4M3;
    g.a_scale = in.scale.as<float>(), g.b_scale = weight_scales + el * kFp8ScaleStride;
    return g;
  });
}

std::vector<GemmArgs> MoeLayerImpl::ExpertDataGemms(Fp8Gemm gemm,
                                                    const std::vector<int64_t>& group_rows,
                                                    const void* in, const Fp8Rows& in_fp8,
                                                    int64_t k, const LayerParam& w, bool transposed,
                                                    int64_t n, void* out) const {
  if (Fp8(gemm)) {
    return Fp8ExpertGemms(group_rows, in_fp8, k, transposed ? w.compute.data() : w.compute_t.data(),
                          w.compute_scale.as<float>(), n, out);
  }
  const DType cd = ExpertRowDType(config_);
  const size_t cs = DTypeSize(cd);
  // A bf16 GEMM of an FP8 layer reads the bf16 copy, the BF16 layer's `compute` bytes.
  const char* weights = static_cast<const char*>(
      config_.compute_dtype == DType::kFloat8E4M3 ? w.compute_bf16.data() : ComputeWeights(w));
  return PerExpert(group_rows, [&](int64_t el, int64_t off, int64_t m) {
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

std::vector<GemmArgs> MoeLayerImpl::ExpertWeightGradGemms(
    Fp8Gemm gemm, const std::vector<int64_t>& group_rows, const void* in, const Fp8Rows& in_fp8,
    int64_t in_cols, const void* d_out, const Fp8Rows& d_out_fp8, int64_t out_cols,
    const LayerParam& w) const {
  const float beta = w.grad_zero ? 0.0f : 1.0f;
  float* grad = w.grad.as<float>();
  if (Fp8(gemm)) {
    // A = in's codes [in_cols, k_pad], B = d_out's [out_cols, k_pad], both k-contiguous
    // ("TN") with the 16-aligned leading dimension of the grouped layout.
    const int64_t ld = Fp8GroupedColumns(group_rows);
    std::vector<GemmArgs> gemms;
    int64_t column = 0;
    for (size_t el = 0; el < group_rows.size(); ++el) {
      GemmArgs g;
      g.trans_b = true;
      g.m = in_cols, g.n = out_cols, g.k = Fp8PaddedRows(group_rows[el]);
      g.a = in_fp8.columns.as<uint8_t>() + column, g.lda = ld;
      g.b = d_out_fp8.columns.as<uint8_t>() + column, g.ldb = ld;
      g.c = grad + el * in_cols * out_cols, g.ldc = out_cols;
      g.c_type = DType::kFloat32, g.beta = beta;
      g.a_fp8 = in_fp8.fp8, g.b_fp8 = d_out_fp8.fp8;
      g.a_scale = in_fp8.scale.as<float>(), g.b_scale = d_out_fp8.scale.as<float>();
      gemms.push_back(g);
      column += g.k;
    }
    return gemms;
  }
  const DType cd = ExpertRowDType(config_);
  const size_t cs = DTypeSize(cd);
  return PerExpert(group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.trans_a = true;
    g.m = in_cols, g.n = out_cols, g.k = m;
    g.a = static_cast<const char*>(in) + off * in_cols * cs, g.lda = in_cols;
    g.b = static_cast<const char*>(d_out) + off * out_cols * cs, g.ldb = out_cols;
    g.c = grad + el * in_cols * out_cols, g.ldc = out_cols;
    g.ab_type = cd, g.c_type = DType::kFloat32, g.beta = beta;
    return g;
  });
}

absl::Status MoeLayerImpl::ExpertsForward(SavedStep& s, ForwardWork& w) {
  const LayerConfig& c = config_;
  const DType cd = ExpertRowDType(c);
  const size_t cs = DTypeSize(cd);
  const int64_t H = c.hidden, F = c.ffn, up = UpWidth(c);
  const DispatchPlan& plan = s.plan;
  const bool fp8 = c.compute_dtype == DType::kFloat8E4M3;
  ASSIGN_OR_RETURN(s.h, backend_->Allocate(plan.expert_rows * up * cs));
  ASSIGN_OR_RETURN(Buffer act, backend_->Allocate(plan.expert_rows * F * cs));
  ASSIGN_OR_RETURN(w.y_expert, backend_->Allocate(plan.expert_rows * H * cs));
  void* h = s.h.data();
  void* y = w.y_expert.data();
  // h = X_e . wi_e   ([rows, H] x [H, up])
  s.x_fp8.want_rows = Fp8(Fp8Gemm::kFc1Fprop);
  s.x_fp8.want_columns = Fp8(Fp8Gemm::kFc1Wgrad);
  RETURN_IF_ERROR(PrepareFp8(Fp8Tensor::kX, /*producer_amax=*/false, plan.expert_rows, s.x_fp8));
  RETURN_IF_ERROR(QuantizeExpertRows(plan.group_rows, s.x_expert.data(), H, s.x_fp8));
  RETURN_IF_ERROR(backend_->GroupedGemm(ExpertDataGemms(Fp8Gemm::kFc1Fprop, plan.group_rows,
                                                        s.x_expert.data(), s.x_fp8, H, *Find("wi"),
                                                        /*transposed=*/false, up, h)));
  s.x_fp8.rows.Reset();
  // An FP8 d_wi reads X_e's grouped codes only (SavedStep::x_fp8); a bf16 one X_e itself.
  if (fp8 && Fp8(Fp8Gemm::kFc1Wgrad)) s.x_expert.Reset();
  ActivationArgs aa;
  aa.activation = c.activation, aa.gated = c.gated, aa.rows = plan.expert_rows, aa.ffn = F;
  aa.dtype = cd, aa.h = h, aa.a = act.data();
  aa.up_bias = c.use_bias ? Find("wi_bias")->master.as<float>() : nullptr;
  aa.group_rows = plan.group_rows;
  // FP8: the activation kernel finds a's amax
  s.act_fp8.want_rows = Fp8(Fp8Gemm::kFc2Fprop);
  s.act_fp8.want_columns = Fp8(Fp8Gemm::kFc2Wgrad);
  RETURN_IF_ERROR(PrepareFp8(Fp8Tensor::kAct, /*producer_amax=*/true, plan.expert_rows, s.act_fp8));
  aa.amax = s.act_fp8.amax();
  RETURN_IF_ERROR(backend_->ActivationForward(aa));
  // y = a . wo_e   ([rows, F] x [F, H])
  RETURN_IF_ERROR(QuantizeExpertRows(plan.group_rows, act.data(), F, s.act_fp8));
  RETURN_IF_ERROR(backend_->GroupedGemm(ExpertDataGemms(Fp8Gemm::kFc2Fprop, plan.group_rows,
                                                        act.data(), s.act_fp8, F, *Find("wo"),
                                                        /*transposed=*/false, H, y)));
  s.act_fp8.rows.Reset();
  if (!fp8 || !Fp8(Fp8Gemm::kFc2Wgrad)) s.act = std::move(act);
  if (c.use_bias) {
    RETURN_IF_ERROR(
        backend_->AddGroupBias(y, cd, Find("wo_bias")->master.as<float>(), H, plan.group_rows));
  }
  return absl::OkStatus();
}

absl::Status MoeLayerImpl::ExpertsBackward(SavedStep& s, Buffer& d_y_buffer, void* d_x_expert) {
  const LayerConfig& c = config_;
  const DType cd = ExpertRowDType(c);
  const size_t cs = DTypeSize(cd);
  const int64_t H = c.hidden, F = c.ffn, up = UpWidth(c);
  const DispatchPlan& plan = s.plan;
  LayerParam& wi = *Find("wi");
  LayerParam& wo = *Find("wo");
  const void* d_y = d_y_buffer.data();
  const size_t d_h_bytes = plan.expert_rows * up * cs;
  const size_t step_bytes = s.x_expert.size() + s.act.size() + d_y_buffer.size() + d_h_bytes;
  // defer: this step's weight gradients join deferred_; flush: and then the step that brings
  // deferred_ to its budget runs every deferred one beside its own data gradients, as an
  // immediate backward runs its own (BackwardPhaseGemms).
  const bool defer = DeferWeightGradients(step_bytes);
  const bool flush = defer && deferred_bytes_ + step_bytes >= deferred_budget_bytes_;
  if (defer) {
    DeferredWeightGrads step;
    step.group_rows = plan.group_rows;
    step.x = std::move(s.x_expert);
    step.act = std::move(s.act);
    step.d_y = std::move(d_y_buffer);  // d_y stays valid: the memory moves with the Buffer
    deferred_bytes_ += step_bytes;
    deferred_.push_back(std::move(step));
  }
  ASSIGN_OR_RETURN(Buffer d_act, backend_->Allocate(plan.expert_rows * F * cs));
  Fp8Rows d_y_fp8;
  d_y_fp8.fp8 = kGradientFp8;
  d_y_fp8.want_rows = Fp8(Fp8Gemm::kFc2Dgrad);
  d_y_fp8.want_columns = Fp8(Fp8Gemm::kFc2Wgrad);
  RETURN_IF_ERROR(PrepareFp8(Fp8Tensor::kDy, /*producer_amax=*/false, plan.expert_rows, d_y_fp8));
  RETURN_IF_ERROR(QuantizeExpertRows(plan.group_rows, d_y, H, d_y_fp8));
  // d_a = d_y . wo_e^T   ([rows, H] x [H, F]; wo_e stored [F, H]), beside
  // d_wo_e += a^T . d_y   ([F, rows] x [rows, H]) unless deferred (then, when flushing, beside
  // the deferred steps' d_wo over all their rows).
  const std::vector<GemmArgs> d_a_gemms =
      ExpertDataGemms(Fp8Gemm::kFc2Dgrad, plan.group_rows, d_y, d_y_fp8, H, wo,
                      /*transposed=*/true, F, d_act.data());
  if (!defer || flush) {
    Buffer gathered[2];
    ASSIGN_OR_RETURN(const std::vector<GemmArgs> d_wo_gemms,
                     defer ? DeferredWeightGradGemms(wo, &DeferredWeightGrads::act, F,
                                                     &DeferredWeightGrads::d_y, H, gathered)
                           : ExpertWeightGradGemms(Fp8Gemm::kFc2Wgrad, plan.group_rows,
                                                   s.act.data(), s.act_fp8, F, d_y, d_y_fp8, H,
                                                   wo));
    RETURN_IF_ERROR(BackwardPhaseGemms(backend_, d_a_gemms, d_wo_gemms,
                                       /*accumulating=*/!wo.grad_zero));
    wo.grad_zero = false;
  } else {
    RETURN_IF_ERROR(backend_->GroupedGemm(d_a_gemms));
  }
  d_y_fp8 = Fp8Rows{};
  if (c.use_bias) {
    LayerParam& wo_bias = *Find("wo_bias");
    RETURN_IF_ERROR(MaterializeGradient(wo_bias));
    RETURN_IF_ERROR(backend_->GroupBiasGrad(d_y, cd, H, plan.group_rows, wo_bias.grad.as<float>()));
  }
  if (flush) {  // every step's d_wo is enqueued: their operands can go
    for (DeferredWeightGrads& d : deferred_) d.act.Reset(), d.d_y.Reset();
  }
  ASSIGN_OR_RETURN(Buffer d_h, backend_->Allocate(d_h_bytes));
  ActivationArgs aa;
  aa.activation = c.activation, aa.gated = c.gated, aa.rows = plan.expert_rows, aa.ffn = F;
  aa.dtype = cd, aa.h = s.h.data(), aa.d_a = d_act.data(), aa.d_h = d_h.data();
  aa.group_rows = plan.group_rows;
  Fp8Rows d_h_fp8;
  d_h_fp8.fp8 = kGradientFp8;
  d_h_fp8.want_rows = Fp8(Fp8Gemm::kFc1Dgrad);
  d_h_fp8.want_columns = Fp8(Fp8Gemm::kFc1Wgrad);
  // FP8: the activation kernel finds d_h's amax
  RETURN_IF_ERROR(PrepareFp8(Fp8Tensor::kDh, /*producer_amax=*/true, plan.expert_rows, d_h_fp8));
  aa.amax = d_h_fp8.amax();
  RETURN_IF_ERROR(backend_->ActivationBackward(aa));
  d_act.Reset();
  if (c.use_bias) {
    LayerParam& wi_bias = *Find("wi_bias");
    RETURN_IF_ERROR(MaterializeGradient(wi_bias));
    RETURN_IF_ERROR(
        backend_->GroupBiasGrad(d_h.data(), cd, up, plan.group_rows, wi_bias.grad.as<float>()));
  }
  // d_X_e = d_h . wi_e^T   ([rows, up] x [up, H]; wi_e stored [H, up]), beside
  // d_wi_e += X_e^T . d_h   ([H, rows] x [rows, up]) unless deferred (as d_wo above).
  RETURN_IF_ERROR(QuantizeExpertRows(plan.group_rows, d_h.data(), up, d_h_fp8));
  const std::vector<GemmArgs> d_x_gemms =
      ExpertDataGemms(Fp8Gemm::kFc1Dgrad, plan.group_rows, d_h.data(), d_h_fp8, up, wi,
                      /*transposed=*/true, H, d_x_expert);
  if (!defer) {
    RETURN_IF_ERROR(
        BackwardPhaseGemms(backend_, d_x_gemms,
                           ExpertWeightGradGemms(Fp8Gemm::kFc1Wgrad, plan.group_rows,
                                                 s.x_expert.data(), s.x_fp8, H, d_h.data(),
                                                 d_h_fp8, up, wi),
                           /*accumulating=*/!wi.grad_zero));
    wi.grad_zero = false;
    return absl::OkStatus();
  }
  deferred_.back().d_h = std::move(d_h);
  if (!flush) return backend_->GroupedGemm(d_x_gemms);
  Buffer gathered[2];
  ASSIGN_OR_RETURN(const std::vector<GemmArgs> d_wi_gemms,
                   DeferredWeightGradGemms(wi, &DeferredWeightGrads::x, H,
                                           &DeferredWeightGrads::d_h, up, gathered));
  RETURN_IF_ERROR(BackwardPhaseGemms(backend_, d_x_gemms, d_wi_gemms,
                                     /*accumulating=*/!wi.grad_zero));
  wi.grad_zero = false;
  deferred_.clear();
  deferred_bytes_ = 0;
  return absl::OkStatus();
}

bool MoeLayerImpl::DeferWeightGradients(size_t step_bytes) const {
  if (config_.compute_dtype == DType::kFloat8E4M3 || deferred_budget_bytes_ == 0) return false;
  return !deferred_.empty() || step_bytes < deferred_budget_bytes_;
}

absl::Status MoeLayerImpl::FlushGradients() {
  if (deferred_.empty()) return absl::OkStatus();
  const absl::Status status = RunDeferredWeightGrads();
  // The operands are freed either way: on an error the gradients are unusable until zeroed,
  // as after any failed backward.
  deferred_.clear();
  deferred_bytes_ = 0;
  return status;
}

absl::Status MoeLayerImpl::RunDeferredWeightGrads() {
  const LayerConfig& c = config_;
  const int64_t H = c.hidden, F = c.ffn, up = UpWidth(c);
  LayerParam& wi = *Find("wi");
  LayerParam& wo = *Find("wo");
  {
    Buffer gathered[2];
    ASSIGN_OR_RETURN(const std::vector<GemmArgs> gemms,
                     DeferredWeightGradGemms(wo, &DeferredWeightGrads::act, F,
                                             &DeferredWeightGrads::d_y, H, gathered));
    RETURN_IF_ERROR(backend_->GroupedGemm(gemms));
    wo.grad_zero = false;
  }
  for (DeferredWeightGrads& d : deferred_) d.act.Reset(), d.d_y.Reset();  // enqueued: can go
  Buffer gathered[2];
  ASSIGN_OR_RETURN(const std::vector<GemmArgs> gemms,
                   DeferredWeightGradGemms(wi, &DeferredWeightGrads::x, H,
                                           &DeferredWeightGrads::d_h, up, gathered));
  RETURN_IF_ERROR(backend_->GroupedGemm(gemms));
  wi.grad_zero = false;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<GemmArgs>> MoeLayerImpl::DeferredWeightGradGemms(
    const LayerParam& w, Buffer DeferredWeightGrads::*in, int64_t in_cols,
    Buffer DeferredWeightGrads::*d_out, int64_t out_cols, Buffer (&gathered)[2]) {
  const size_t cs = DTypeSize(ExpertRowDType(config_));
  const Fp8Rows none;
  // Deferral never runs under FP8 (DeferWeightGradients): these GEMMs are the BF16 ones.
  const Fp8Gemm gemm = w.name == "wi" ? Fp8Gemm::kFc1Wgrad : Fp8Gemm::kFc2Wgrad;
  if (deferred_.size() == 1) {  // the step's own layout: the GEMMs its backward would run
    const DeferredWeightGrads& d = deferred_[0];
    return ExpertWeightGradGemms(gemm, d.group_rows, (d.*in).data(), none, in_cols, (d.*d_out).data(),
                                 none, out_cols, w);
  }
  // Expert el's rows of every step, in step order, become expert el's rows of one layout.
  std::vector<int64_t> group_rows(local_experts_, 0);
  for (const DeferredWeightGrads& d : deferred_) {
    for (int64_t el = 0; el < local_experts_; ++el) group_rows[el] += d.group_rows[el];
  }
  int64_t rows = 0;
  for (int64_t r : group_rows) rows += r;
  ASSIGN_OR_RETURN(gathered[0], backend_->Allocate(rows * in_cols * cs));
  ASSIGN_OR_RETURN(gathered[1], backend_->Allocate(rows * out_cols * cs));
  std::vector<int64_t> dst(local_experts_, 0);  // where expert el's next rows go
  for (int64_t el = 1; el < local_experts_; ++el) dst[el] = dst[el - 1] + group_rows[el - 1];
  for (const DeferredWeightGrads& d : deferred_) {
    std::vector<RowBlock> blocks;
    int64_t src = 0;
    for (int64_t el = 0; el < local_experts_; ++el) {
      if (d.group_rows[el] > 0) blocks.push_back({src, dst[el], d.group_rows[el]});
      src += d.group_rows[el];
      dst[el] += d.group_rows[el];
    }
    RETURN_IF_ERROR(
        backend_->CopyRowBlocks((d.*in).data(), gathered[0].data(), in_cols * cs, blocks));
    RETURN_IF_ERROR(
        backend_->CopyRowBlocks((d.*d_out).data(), gathered[1].data(), out_cols * cs, blocks));
  }
  return ExpertWeightGradGemms(gemm, group_rows, gathered[0].data(), none, in_cols, gathered[1].data(),
                               none, out_cols, w);
}

}  // namespace moe
