// MoeLayer forward and backward (docs/SPEC.md "Forward", "Backward"), written once against the
// Backend and Communicator seams. Host round trips per forward: one CopyToHost of the step
// statistics (counts, loss partials), one of the all-gathered row counts A[R, E], and the
// output itself; the backward has only the d_x copy. Every buffer a kernel or a collective
// touches is backend memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/moe_layer_impl.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

int64_t RoundUp(int64_t n, int64_t align) { return align > 0 ? (n + align - 1) / align * align : n; }

// Largest token count of a step and row count of a layout: rows are indexed by int32.
constexpr int64_t kMaxRowIndex = std::numeric_limits<int32_t>::max();

// The padded counts A[R, E] of every rank must keep every rank's local and expert layouts
// indexable by int32. Checked on the all-gathered matrix, so every rank gives the same answer.
absl::Status CheckRowCounts(const std::vector<int64_t>& counts, int ranks, int64_t experts) {
  const int64_t local_experts = experts / ranks;
  std::vector<int64_t> local_rows(ranks, 0), expert_rows(ranks, 0);
  for (int s = 0; s < ranks; ++s) {
    for (int64_t e = 0; e < experts; ++e) {
      local_rows[s] += counts[s * experts + e];
      expert_rows[e / local_experts] += counts[s * experts + e];
    }
  }
  for (int q = 0; q < ranks; ++q) {
    const int64_t rows = std::max(local_rows[q], expert_rows[q]);
    if (rows > kMaxRowIndex) {
      return absl::InvalidArgumentError(
          absl::StrCat("x: rank ", q, " would hold ", rows,
                       " permuted rows (after align_size padding); at most ", kMaxRowIndex,
                       " are supported"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckActivations(const char* field, const Tensor& t, int64_t hidden) {
  if (t.rank() != 2 || t.dim(1) != hidden) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected shape [T, ", hidden,
                                                   "], got ", t.ShapeString()));
  }
  if (t.dtype() != DType::kFloat32 && t.dtype() != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": datatype must be FP32 or BF16, got ", DTypeName(t.dtype())));
  }
  return absl::OkStatus();
}

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

absl::Status MoeLayerImpl::ExpertsForward(const DispatchPlan& plan, const void* x_expert,
                                          void* h, void* act, void* y) {
  const LayerConfig& c = config_;
  const DType cd = c.compute_dtype;
  const size_t cs = DTypeSize(cd);
  const int64_t H = c.hidden, F = c.ffn, up = UpWidth(c);
  const char* wi = static_cast<const char*>(ComputeWeights(*Find("wi")));
  const char* wo = static_cast<const char*>(ComputeWeights(*Find("wo")));
  // h = X_e . wi_e   ([rows, H] x [H, up])
  RETURN_IF_ERROR(PerExpert(backend_, plan.group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.m = m, g.n = up, g.k = H;
    g.a = static_cast<const char*>(x_expert) + off * H * cs, g.lda = H;
    g.b = wi + el * H * up * cs, g.ldb = up;
    g.c = static_cast<char*>(h) + off * up * cs, g.ldc = up;
    g.ab_type = cd, g.c_type = cd;
    return g;
  }));
  ActivationArgs aa;
  aa.activation = c.activation, aa.gated = c.gated, aa.rows = plan.expert_rows, aa.ffn = F;
  aa.dtype = cd, aa.h = h, aa.a = act;
  aa.up_bias = c.use_bias ? Find("wi_bias")->master.as<float>() : nullptr;
  aa.group_rows = plan.group_rows;
  RETURN_IF_ERROR(backend_->ActivationForward(aa));
  // y = a . wo_e   ([rows, F] x [F, H])
  RETURN_IF_ERROR(PerExpert(backend_, plan.group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.m = m, g.n = H, g.k = F;
    g.a = static_cast<const char*>(act) + off * F * cs, g.lda = F;
    g.b = wo + el * F * H * cs, g.ldb = H;
    g.c = static_cast<char*>(y) + off * H * cs, g.ldc = H;
    g.ab_type = cd, g.c_type = cd;
    return g;
  }));
  if (c.use_bias) {
    RETURN_IF_ERROR(
        backend_->AddGroupBias(y, cd, Find("wo_bias")->master.as<float>(), H, plan.group_rows));
  }
  return absl::OkStatus();
}

absl::StatusOr<ForwardResult> MoeLayerImpl::Forward(const Tensor& x,
                                                    std::unique_ptr<StepContext>* saved,
                                                    Tensor* out_into) {
  const LayerConfig& c = config_;
  RETURN_IF_ERROR(CheckActivations("x", x, c.hidden));
  const int64_t T = x.dim(0), H = c.hidden, E = c.num_experts, K = c.top_k;
  const int64_t F = c.ffn, up = UpWidth(c);
  const DType cd = c.compute_dtype, xt = x.dtype();
  RETURN_IF_ERROR(CheckOutputDestination("out", out_into, xt, {T, H}));
  const size_t cs = DTypeSize(cd);
  auto s = std::make_unique<SavedStep>();
  s->layer = this;
  s->tokens = T;
  s->x_type = xt;

  // Input: x as uploaded, its fp32 view (router) and its compute-dtype view (experts).
  ASSIGN_OR_RETURN(Buffer x_in, Upload(x.raw(), x.num_bytes()));
  Buffer x_compute;
  if (xt == DType::kFloat32) {
    s->x32 = std::move(x_in);
  } else {
    ASSIGN_OR_RETURN(s->x32, backend_->Allocate(T * H * sizeof(float)));
    RETURN_IF_ERROR(backend_->Convert(x_in.data(), xt, s->x32.data(), DType::kFloat32, T * H));
    if (cd == DType::kBFloat16) x_compute = std::move(x_in);
  }
  if (cd == DType::kBFloat16 && x_compute.data() == nullptr) {
    ASSIGN_OR_RETURN(x_compute, backend_->Allocate(T * H * cs));
    RETURN_IF_ERROR(backend_->Convert(s->x32.data(), DType::kFloat32, x_compute.data(), cd, T * H));
  }
  const void* x_c = cd == DType::kFloat32 ? s->x32.data() : x_compute.data();

  // 1. Logits z = x . gate (fp32).
  ASSIGN_OR_RETURN(s->logits, backend_->Allocate(T * E * sizeof(float)));
  {
    GemmArgs g;
    g.m = T, g.n = E, g.k = H;
    g.a = s->x32.data(), g.lda = H;
    g.b = Find("gate")->master.data(), g.ldb = E;
    g.c = s->logits.data(), g.ldc = E;
    RETURN_IF_ERROR(backend_->Gemm(g));
  }
  // 2-6. Router. Step statistics, one buffer so that one copy brings them to the host:
  //   double [E + 2]: [0, E) sum_t P[t, e], [E] sum_t lse^2, [E + 1] tokens (T, then T_g)
  //   int32 [E]: (token, slot) pairs per expert before drops (local, then global f)
  //   int32 [E]: pairs kept per expert after the capacity drop (local)
  const size_t stats_doubles = static_cast<size_t>(E + 2);
  ASSIGN_OR_RETURN(Buffer stats,
                   backend_->Allocate(stats_doubles * sizeof(double) + 2 * E * sizeof(int32_t)));
  double* loss_partials = stats.as<double>();
  int32_t* expert_counts = reinterpret_cast<int32_t*>(loss_partials + stats_doubles);
  int32_t* kept_counts = expert_counts + E;
  ASSIGN_OR_RETURN(s->scores, backend_->Allocate(T * E * sizeof(float)));
  ASSIGN_OR_RETURN(s->logsumexp, backend_->Allocate(T * sizeof(float)));
  ASSIGN_OR_RETURN(s->topk_expert, backend_->Allocate(T * K * sizeof(int32_t)));
  ASSIGN_OR_RETURN(s->topk_weight, backend_->Allocate(T * K * sizeof(float)));
  {
    RouterForwardArgs r;
    r.config = &c;
    r.tokens = T;
    r.logits = s->logits.as<float>();
    r.expert_bias = c.use_expert_bias ? Find("expert_bias")->master.as<float>() : nullptr;
    r.topk_expert = s->topk_expert.as<int32_t>();
    r.topk_weight = s->topk_weight.as<float>();
    r.scores = s->scores.as<float>();
    r.logsumexp = s->logsumexp.as<float>();
    r.expert_counts = expert_counts;
    r.loss_partials = loss_partials;
    RETURN_IF_ERROR(backend_->RouterForward(r));
  }
  const double tokens_here = static_cast<double>(T);
  RETURN_IF_ERROR(backend_->CopyFromHost(loss_partials + E + 1, &tokens_here, sizeof(double)));
  // Only [E]-sized vectors and scalars cross ranks; logits never do (docs/SPEC.md Forward 5).
  RETURN_IF_ERROR(comm_->AllReduceSum(loss_partials, stats_doubles, DType::kFloat64));
  RETURN_IF_ERROR(comm_->AllReduceSum(expert_counts, E, DType::kInt32));

  // 7. Capacity (per rank, from the local T).
  ASSIGN_OR_RETURN(Buffer kept, backend_->Allocate(T * K));
  {
    RoutePlanArgs p;
    p.tokens = T, p.top_k = K, p.num_experts = E;
    // No expert gets more than T pairs (a token's k experts are distinct), so clamping to T
    // changes nothing and keeps a huge capacity_factor from overflowing the int64 conversion.
    const double capacity = std::ceil(c.capacity_factor * T * K / E);
    p.capacity = c.capacity_factor > 0 ? (capacity < T ? static_cast<int64_t>(capacity) : T) : -1;
    p.topk_expert = s->topk_expert.as<int32_t>();
    p.topk_weight = s->topk_weight.as<float>();
    p.kept = kept.as<uint8_t>();
    p.kept_counts = kept_counts;
    RETURN_IF_ERROR(backend_->RoutePlan(p));
  }
  std::vector<char> host_stats(stats.size());
  RETURN_IF_ERROR(backend_->CopyToHost(host_stats.data(), stats.data(), stats.size()));
  std::vector<double> sums(stats_doubles);
  std::memcpy(sums.data(), host_stats.data(), stats_doubles * sizeof(double));
  std::vector<int32_t> counts32(2 * E);
  std::memcpy(counts32.data(), host_stats.data() + stats_doubles * sizeof(double),
              2 * E * sizeof(int32_t));
  s->global_tokens = sums[E + 1];
  // Per-expert counts are int32 (and so are token and row indices): refuse a step too large for
  // them. T_g is the same on every rank, so all ranks fail here together.
  if (s->global_tokens > static_cast<double>(kMaxRowIndex)) {
    return absl::InvalidArgumentError(absl::StrCat("x: the step has ", s->global_tokens,
                                                   " tokens over all ranks; at most ",
                                                   kMaxRowIndex, " are supported"));
  }
  s->global_counts.assign(counts32.begin(), counts32.begin() + E);

  // 8. Padded rows per expert; 9. all-gather them into A[R, E] (int64).
  std::vector<int64_t> padded(E), offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    padded[e] = RoundUp(counts32[E + e], c.align_size);
    offsets[e + 1] = offsets[e] + padded[e];
  }
  ASSIGN_OR_RETURN(Buffer my_counts, Upload(padded.data(), E * sizeof(int64_t)));
  ASSIGN_OR_RETURN(Buffer all_counts, backend_->Allocate(ranks_ * E * sizeof(int64_t)));
  RETURN_IF_ERROR(comm_->AllGather(my_counts.data(), all_counts.data(), E * sizeof(int64_t)));
  std::vector<int64_t> counts_matrix(ranks_ * E);
  RETURN_IF_ERROR(backend_->CopyToHost(counts_matrix.data(), all_counts.data(),
                                       counts_matrix.size() * sizeof(int64_t)));
  RETURN_IF_ERROR(CheckRowCounts(counts_matrix, ranks_, E));
  ASSIGN_OR_RETURN(s->plan, BuildDispatchPlan(counts_matrix, ranks_, rank_, E));
  const DispatchPlan& plan = s->plan;
  if (plan.local_rows != offsets[E]) {
    return absl::InternalError("all-gathered row counts disagree with this rank's own");
  }

  // 8. Permute: local layout [e0 rows | e1 rows | ...] with zero padding rows.
  ASSIGN_OR_RETURN(Buffer offsets_dev, Upload(offsets.data(), (E + 1) * sizeof(int64_t)));
  ASSIGN_OR_RETURN(s->pair_row, backend_->Allocate(T * K * sizeof(int32_t)));
  ASSIGN_OR_RETURN(Buffer row_token, backend_->Allocate(plan.local_rows * sizeof(int32_t)));
  {
    PermuteArgs p;
    p.tokens = T, p.top_k = K, p.num_experts = E, p.total_rows = plan.local_rows;
    p.topk_expert = s->topk_expert.as<int32_t>();
    p.kept = kept.as<uint8_t>();
    p.expert_offsets = offsets_dev.as<int64_t>();
    p.pair_row = s->pair_row.as<int32_t>();
    p.row_token = row_token.as<int32_t>();
    RETURN_IF_ERROR(backend_->Permute(p));
  }
  ASSIGN_OR_RETURN(Buffer x_local, backend_->Allocate(plan.local_rows * H * cs));
  RETURN_IF_ERROR(backend_->GatherRows(x_c, row_token.as<int32_t>(), plan.local_rows, H, cd,
                                       x_local.data()));
  // 9. Dispatch to the owners, expert layout (one rank: already is).
  if (DispatchIsIdentity(plan)) {
    s->x_expert = std::move(x_local);
  } else {
    ASSIGN_OR_RETURN(s->x_expert, backend_->Allocate(plan.expert_rows * H * cs));
    RETURN_IF_ERROR(
        DispatchRows(backend_, comm_, plan, x_local.data(), s->x_expert.data(), H * cs));
    x_local.Reset();
  }

  // 10. Expert FFN.
  ASSIGN_OR_RETURN(s->h, backend_->Allocate(plan.expert_rows * up * cs));
  ASSIGN_OR_RETURN(s->act, backend_->Allocate(plan.expert_rows * F * cs));
  ASSIGN_OR_RETURN(Buffer y_expert, backend_->Allocate(plan.expert_rows * H * cs));
  RETURN_IF_ERROR(
      ExpertsForward(plan, s->x_expert.data(), s->h.data(), s->act.data(), y_expert.data()));

  // 11. Combine: back to the local layout, then the weighted sum in slot order (fp32).
  if (DispatchIsIdentity(plan)) {
    s->y_local = std::move(y_expert);
  } else {
    ASSIGN_OR_RETURN(s->y_local, backend_->Allocate(plan.local_rows * H * cs));
    RETURN_IF_ERROR(
        ReturnRows(backend_, comm_, plan, y_expert.data(), s->y_local.data(), H * cs));
    y_expert.Reset();
  }
  ASSIGN_OR_RETURN(Buffer out, backend_->Allocate(T * H * DTypeSize(xt)));
  RETURN_IF_ERROR(backend_->CombineRows(s->y_local.data(), cd, s->pair_row.as<int32_t>(),
                                        s->topk_weight.as<float>(), T, K, H, out.data(), xt));
  ForwardResult result;
  ASSIGN_OR_RETURN(result.out, DownloadInto(out, xt, {T, H}, out_into));

  // Losses over the global token count.
  const double Tg = s->global_tokens;
  if (c.aux_loss_coeff > 0 && Tg > 0) {
    const double coeff = E * c.aux_loss_coeff / (K * Tg * Tg);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += sums[e] * static_cast<double>(s->global_counts[e]);
    result.aux_loss = coeff * sum;
  }
  if (c.z_loss_coeff > 0 && Tg > 0) result.z_loss = c.z_loss_coeff / Tg * sums[E];
  result.tokens_per_expert = s->global_counts;
  for (int64_t e = 0; e < E; ++e) accumulated_counts_[e] += s->global_counts[e];

  if (saved != nullptr) *saved = std::move(s);
  return result;
}

absl::Status MoeLayerImpl::ExpertsBackward(const SavedStep& s, const void* d_y, void* d_x_expert) {
  const LayerConfig& c = config_;
  const DType cd = c.compute_dtype;
  const size_t cs = DTypeSize(cd);
  const int64_t H = c.hidden, F = c.ffn, up = UpWidth(c);
  const DispatchPlan& plan = s.plan;
  LayerParam& wi = *Find("wi");
  LayerParam& wo = *Find("wo");
  const char* wi_c = static_cast<const char*>(ComputeWeights(wi));
  const char* wo_c = static_cast<const char*>(ComputeWeights(wo));
  const char* dy = static_cast<const char*>(d_y);
  ASSIGN_OR_RETURN(Buffer d_act, backend_->Allocate(plan.expert_rows * F * cs));
  // d_a = d_y . wo_e^T   ([rows, H] x [H, F]; wo_e stored [F, H])
  RETURN_IF_ERROR(PerExpert(backend_, plan.group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.trans_b = true;
    g.m = m, g.n = F, g.k = H;
    g.a = dy + off * H * cs, g.lda = H;
    g.b = wo_c + el * F * H * cs, g.ldb = H;
    g.c = d_act.as<char>() + off * F * cs, g.ldc = F;
    g.ab_type = cd, g.c_type = cd;
    return g;
  }));
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
  // d_X_e = d_h . wi_e^T   ([rows, up] x [up, H]; wi_e stored [H, up])
  return PerExpert(backend_, plan.group_rows, [&](int64_t el, int64_t off, int64_t m) {
    GemmArgs g;
    g.trans_b = true;
    g.m = m, g.n = H, g.k = up;
    g.a = d_h.as<char>() + off * up * cs, g.lda = up;
    g.b = wi_c + el * H * up * cs, g.ldb = up;
    g.c = static_cast<char*>(d_x_expert) + off * H * cs, g.ldc = H;
    g.ab_type = cd, g.c_type = cd;
    return g;
  });
}

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
  const LayerConfig& c = config_;
  const int64_t T = s->tokens, H = c.hidden, E = c.num_experts, K = c.top_k;
  const DType cd = c.compute_dtype;
  const size_t cs = DTypeSize(cd);
  RETURN_IF_ERROR(CheckActivations("d_out", d_out, H));
  if (d_out.dim(0) != T) {
    return absl::InvalidArgumentError(absl::StrCat("d_out: expected shape [", T, ", ", H,
                                                   "] (the forward's), got ",
                                                   d_out.ShapeString()));
  }
  if (!std::isfinite(d_aux) || !std::isfinite(d_z_loss)) {
    return absl::InvalidArgumentError("Backward: d_aux and d_z_loss must be finite");
  }
  RETURN_IF_ERROR(CheckOutputDestination("d_x", d_x_into, s->x_type, {T, H}));
  s->used = true;
  const DispatchPlan& plan = s->plan;

  // 1. Combine backward: d_y in the local layout and d_probs.
  ASSIGN_OR_RETURN(Buffer d_out_dev, Upload(d_out.raw(), d_out.num_bytes()));
  ASSIGN_OR_RETURN(Buffer d_y_local, backend_->Allocate(plan.local_rows * H * cs));
  ASSIGN_OR_RETURN(Buffer d_probs, backend_->Allocate(T * K * sizeof(float)));
  RETURN_IF_ERROR(backend_->CombineBackward(
      d_out_dev.data(), d_out.dtype(), s->y_local.data(), cd, s->pair_row.as<int32_t>(),
      s->topk_weight.as<float>(), T, K, H, plan.local_rows, d_y_local.data(),
      d_probs.as<float>()));
  d_out_dev.Reset();
  // 2. Dispatch d_y exactly as the forward dispatched x (one rank: d_y_local already is).
  const bool identity = DispatchIsIdentity(plan);
  Buffer d_y_expert;
  if (!identity) {
    ASSIGN_OR_RETURN(d_y_expert, backend_->Allocate(plan.expert_rows * H * cs));
    RETURN_IF_ERROR(
        DispatchRows(backend_, comm_, plan, d_y_local.data(), d_y_expert.data(), H * cs));
  }
  // 3. Expert FFN backward.
  ASSIGN_OR_RETURN(Buffer d_x_expert, backend_->Allocate(plan.expert_rows * H * cs));
  RETURN_IF_ERROR(ExpertsBackward(*s, identity ? d_y_local.data() : d_y_expert.data(),
                                  d_x_expert.data()));
  d_y_expert.Reset();
  // 4. Reverse exchange into the local layout (reusing d_y_local; one rank: d_x_expert already
  // is that layout), then d_x_t = sum_j d_X_(t,j).
  if (!identity) {
    RETURN_IF_ERROR(
        ReturnRows(backend_, comm_, plan, d_x_expert.data(), d_y_local.data(), H * cs));
    d_x_expert.Reset();
  }
  const void* d_x_local = identity ? d_x_expert.data() : d_y_local.data();
  ASSIGN_OR_RETURN(Buffer d_x, backend_->Allocate(T * H * sizeof(float)));
  RETURN_IF_ERROR(backend_->CombineRows(d_x_local, cd, s->pair_row.as<int32_t>(), nullptr, T, K,
                                        H, d_x.data(), DType::kFloat32));
  d_y_local.Reset();
  d_x_expert.Reset();

  // 5. Router backward.
  const double Tg = s->global_tokens;
  // dL/dP[t, e] = C * f_e * d_aux. The host copy outlives the upload (asynchronous backends).
  Buffer aux_grad;
  std::vector<float> aux_grad_host(E);
  if (c.aux_loss_coeff > 0 && Tg > 0) {
    const double coeff = E * c.aux_loss_coeff / (K * Tg * Tg);
    for (int64_t e = 0; e < E; ++e) {
      aux_grad_host[e] =
          static_cast<float>(coeff * static_cast<double>(s->global_counts[e]) * d_aux);
    }
    ASSIGN_OR_RETURN(aux_grad, Upload(aux_grad_host.data(), E * sizeof(float)));
  }
  ASSIGN_OR_RETURN(Buffer d_logits, backend_->Allocate(T * E * sizeof(float)));
  {
    RouterBackwardArgs r;
    r.config = &c;
    r.tokens = T;
    r.logits = s->logits.as<float>();
    r.scores = s->scores.as<float>();
    r.logsumexp = s->logsumexp.as<float>();
    r.topk_expert = s->topk_expert.as<int32_t>();
    r.d_topk_weight = d_probs.as<float>();
    r.aux_grad = aux_grad.data() != nullptr ? aux_grad.as<float>() : nullptr;
    r.z_loss_grad_scale = c.z_loss_coeff > 0 && Tg > 0 ? d_z_loss * c.z_loss_coeff / Tg : 0.0;
    r.d_logits = d_logits.as<float>();
    RETURN_IF_ERROR(backend_->RouterBackward(r));
  }
  // 6. d_x += d_z . gate^T; d_gate += all-reduce(x^T . d_z).
  LayerParam& gate = *Find("gate");
  {
    GemmArgs g;
    g.trans_b = true;
    g.m = T, g.n = H, g.k = E;
    g.a = d_logits.data(), g.lda = E;
    g.b = gate.master.data(), g.ldb = E;
    g.c = d_x.data(), g.ldc = H;
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
    g.a = s->x32.data(), g.lda = H;
    g.b = d_logits.data(), g.ldb = E;
    g.c = d_gate, g.ldc = E;
    RETURN_IF_ERROR(backend_->Gemm(g));
  }
  RETURN_IF_ERROR(comm_->AllReduceSum(d_gate, H * E, DType::kFloat32));
  if (gate.grad_zero) {
    gate.grad_zero = false;
  } else {
    RETURN_IF_ERROR(backend_->AddInPlace(gate.grad.as<float>(), d_gate, H * E));
  }

  Tensor result;
  if (s->x_type == DType::kFloat32) {
    ASSIGN_OR_RETURN(result, DownloadInto(d_x, DType::kFloat32, {T, H}, d_x_into));
  } else {
    ASSIGN_OR_RETURN(Buffer d_x_cast, backend_->Allocate(T * H * DTypeSize(s->x_type)));
    RETURN_IF_ERROR(
        backend_->Convert(d_x.data(), DType::kFloat32, d_x_cast.data(), s->x_type, T * H));
    ASSIGN_OR_RETURN(result, DownloadInto(d_x_cast, s->x_type, {T, H}, d_x_into));
  }
  // The saved activations are no longer needed.
  *s = SavedStep{};
  s->used = true;
  s->layer = this;
  return result;
}

}  // namespace moe
