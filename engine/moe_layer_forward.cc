// MoeLayer forward (docs/SPEC.md "Forward"), written once against the Backend and
// Communicator seams: Forward is the list of its stages, each a method documented in
// moe_layer_impl.h. Host round trips per forward: one CopyToHost of the step statistics
// (counts, loss partials and, with several ranks, every rank's kept counts, from which the
// host derives A[R, E]), and the output itself.
// Every buffer a kernel or a collective touches is backend memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/moe_layer_impl.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

int64_t RoundUp(int64_t n, int64_t align) {
  return align > 0 ? (n + align - 1) / align * align : n;
}

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
      return absl::InvalidArgumentError(absl::StrCat(
          "x: rank ", q, " would hold ", rows,
          " permuted rows (after align_size padding); at most ", kMaxRowIndex, " are supported"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckActivations(const char* field, const Tensor& t, int64_t hidden) {
  if (t.rank() != 2 || t.dim(1) != hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected shape [T, ", hidden, "], got ", t.ShapeString()));
  }
  if (t.dtype() != DType::kFloat32 && t.dtype() != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": datatype must be FP32 or BF16, got ", DTypeName(t.dtype())));
  }
  return absl::OkStatus();
}

absl::StatusOr<ForwardResult> MoeLayerImpl::Forward(const Tensor& x,
                                                    std::unique_ptr<StepContext>* saved,
                                                    Tensor* out_into, bool routed_experts) {
  RETURN_IF_ERROR(CheckActivations("x", x, config_.hidden));
  RETURN_IF_ERROR(CheckOutputDestination("out", out_into, x.dtype(), {x.dim(0), config_.hidden}));
  auto s = std::make_unique<SavedStep>();
  s->layer = this;
  s->tokens = x.dim(0);
  s->x_type = x.dtype();
  ForwardWork w;
  RETURN_IF_ERROR(UploadInput(x, *s, w));
  RETURN_IF_ERROR(RouteTokens(*s, w));         // 1-6
  RETURN_IF_ERROR(DropOverCapacity(*s, w));    // 7
  RETURN_IF_ERROR(PlanRows(*s, w));            // row counts of 8 and 9
  RETURN_IF_ERROR(PermuteAndDispatch(*s, w));  // 8-9
  RETURN_IF_ERROR(ExpertsForward(*s, w));      // 10
  ForwardResult result;
  ASSIGN_OR_RETURN(result.out, CombineOutput(*s, w, out_into));  // 11
  AddLosses(*s, w, result);
  if (routed_experts && s->tokens > 0) {
    result.routed_experts.resize(static_cast<size_t>(s->tokens * config_.top_k));
    RETURN_IF_ERROR(backend_->CopyToHost(result.routed_experts.data(), s->topk_expert.data(),
                                         result.routed_experts.size() * sizeof(int32_t)));
  }
  if (saved != nullptr) *saved = std::move(s);
  return result;
}

absl::Status MoeLayerImpl::UploadInput(const Tensor& x, SavedStep& s, ForwardWork& w) {
  const int64_t T = s.tokens, H = config_.hidden;
  const DType cd = ExpertRowDType(config_), xt = x.dtype();
  // x as uploaded, its fp32 view (router) and its compute-dtype view (experts).
  ASSIGN_OR_RETURN(Buffer x_in, Upload(x.raw(), x.num_bytes()));
  if (xt == DType::kFloat32) {
    s.x32 = std::move(x_in);
    if (cd == DType::kBFloat16) {
      ASSIGN_OR_RETURN(w.x_compute, backend_->Allocate(T * H * DTypeSize(cd)));
      RETURN_IF_ERROR(
          backend_->Convert(s.x32.data(), DType::kFloat32, w.x_compute.data(), cd, T * H));
    }
  } else {
    // A backend whose router GEMMs read x16 (GemmReadsBf16A) needs no fp32 copy unless the
    // experts compute in fp32.
    if (cd == DType::kFloat32 || !backend_->GemmReadsBf16A()) {
      ASSIGN_OR_RETURN(s.x32, backend_->Allocate(T * H * sizeof(float)));
      RETURN_IF_ERROR(backend_->Convert(x_in.data(), xt, s.x32.data(), DType::kFloat32, T * H));
    }
    s.x16 = std::move(x_in);
  }
  w.x_experts = cd == DType::kFloat32     ? s.x32.data()
                : s.x16.data() != nullptr ? s.x16.data()
                                          : w.x_compute.data();
  return absl::OkStatus();
}

absl::Status MoeLayerImpl::RouteTokens(SavedStep& s, ForwardWork& w) {
  const LayerConfig& c = config_;
  const int64_t T = s.tokens, H = c.hidden, E = c.num_experts, K = c.top_k;
  // 1. Logits z = x . gate (fp32).
  ASSIGN_OR_RETURN(s.logits, backend_->Allocate(T * E * sizeof(float)));
  {
    GemmArgs g;
    g.m = T, g.n = E, g.k = H;
    g.a = s.x32.data(), g.lda = H;
    g.a_bf16 = s.x16.data();
    g.b = Find("gate")->master.data(), g.ldb = E;
    g.c = s.logits.data(), g.ldc = E;
    RETURN_IF_ERROR(backend_->Gemm(g));
  }
  // 2-6. Scores, grouped top-k, top-k and the loss partials, into the step statistics (layout
  // at ForwardWork::stats).
  const size_t stats_doubles = static_cast<size_t>(E + 2);
  const int64_t gathered = ranks_ > 1 ? ranks_ * E : 0;
  ASSIGN_OR_RETURN(w.stats, backend_->Allocate(stats_doubles * sizeof(double) +
                                               (2 * E + gathered) * sizeof(int32_t)));
  double* loss_partials = w.stats.as<double>();
  int32_t* expert_counts = reinterpret_cast<int32_t*>(loss_partials + stats_doubles);
  ASSIGN_OR_RETURN(s.scores, backend_->Allocate(T * E * sizeof(float)));
  ASSIGN_OR_RETURN(s.logsumexp, backend_->Allocate(T * sizeof(float)));
  ASSIGN_OR_RETURN(s.topk_expert, backend_->Allocate(T * K * sizeof(int32_t)));
  ASSIGN_OR_RETURN(s.topk_weight, backend_->Allocate(T * K * sizeof(float)));
  {
    RouterForwardArgs r;
    r.config = &c;
    r.tokens = T;
    r.logits = s.logits.as<float>();
    r.expert_bias = c.use_expert_bias ? Find("expert_bias")->master.as<float>() : nullptr;
    r.topk_expert = s.topk_expert.as<int32_t>();
    r.topk_weight = s.topk_weight.as<float>();
    r.scores = s.scores.as<float>();
    r.logsumexp = s.logsumexp.as<float>();
    r.expert_counts = expert_counts;
    r.loss_partials = loss_partials;
    RETURN_IF_ERROR(backend_->RouterForward(r));
  }
  w.local_tokens = static_cast<double>(T);
  RETURN_IF_ERROR(backend_->CopyFromHost(loss_partials + E + 1, &w.local_tokens, sizeof(double)));
  // Only [E]-sized vectors and scalars cross ranks; logits never do (docs/SPEC.md Forward 5).
  RETURN_IF_ERROR(comm_->AllReduceSum(loss_partials, stats_doubles, DType::kFloat64));
  return comm_->AllReduceSum(expert_counts, E, DType::kInt32);
}

absl::Status MoeLayerImpl::DropOverCapacity(SavedStep& s, ForwardWork& w) {
  const LayerConfig& c = config_;
  const int64_t T = s.tokens, E = c.num_experts, K = c.top_k;
  const size_t stats_doubles = static_cast<size_t>(E + 2);
  // 7. Capacity (per rank, from the local T).
  ASSIGN_OR_RETURN(w.kept, backend_->Allocate(T * K));
  {
    RoutePlanArgs p;
    p.tokens = T, p.top_k = K, p.num_experts = E;
    // No expert gets more than T pairs (a token's k experts are distinct), so clamping to T
    // changes nothing and keeps a huge capacity_factor from overflowing the int64 conversion.
    const double capacity = std::ceil(c.capacity_factor * T * K / E);
    p.capacity = c.capacity_factor > 0 ? (capacity < T ? static_cast<int64_t>(capacity) : T) : -1;
    p.topk_expert = s.topk_expert.as<int32_t>();
    p.topk_weight = s.topk_weight.as<float>();
    p.kept = w.kept.as<uint8_t>();
    p.kept_counts = reinterpret_cast<int32_t*>(w.stats.as<double>() + stats_doubles) + E;
    RETURN_IF_ERROR(backend_->RoutePlan(p));
    // Every rank's kept counts (PlanRows' dispatch plan) come to the host with the statistics:
    // one host round trip for both (the padding to align_size is applied there).
    if (ranks_ > 1) {
      RETURN_IF_ERROR(comm_->AllGather(p.kept_counts, p.kept_counts + E, E * sizeof(int32_t)));
    }
  }
  std::vector<char> host_stats(w.stats.size());
  RETURN_IF_ERROR(backend_->CopyToHost(host_stats.data(), w.stats.data(), w.stats.size()));
  w.loss_sums.resize(stats_doubles);
  std::memcpy(w.loss_sums.data(), host_stats.data(), stats_doubles * sizeof(double));
  std::vector<int32_t> counts32(2 * E);
  std::memcpy(counts32.data(), host_stats.data() + stats_doubles * sizeof(double),
              2 * E * sizeof(int32_t));
  s.global_tokens = w.loss_sums[E + 1];
  // Per-expert counts are int32 (and so are token and row indices): refuse a step too large for
  // them. T_g is the same on every rank, so all ranks fail here together.
  if (s.global_tokens > static_cast<double>(kMaxRowIndex)) {
    return absl::InvalidArgumentError(absl::StrCat("x: the step has ", s.global_tokens,
                                                   " tokens over all ranks; at most ", kMaxRowIndex,
                                                   " are supported"));
  }
  s.global_counts.assign(counts32.begin(), counts32.begin() + E);
  w.kept_counts.assign(counts32.begin() + E, counts32.end());
  if (ranks_ > 1) {
    w.all_kept_counts.resize(ranks_ * E);
    std::memcpy(w.all_kept_counts.data(),
                host_stats.data() + stats_doubles * sizeof(double) + 2 * E * sizeof(int32_t),
                w.all_kept_counts.size() * sizeof(int32_t));
  }
  return absl::OkStatus();
}

absl::Status MoeLayerImpl::PlanRows(SavedStep& s, ForwardWork& w) {
  const int64_t E = config_.num_experts;
  // The row counts of Forward 8 and 9 (the rows themselves move in PermuteAndDispatch): each
  // expert's kept pairs padded to align_size give this rank's local layout; every rank's padded
  // counts A[R, E] give the dispatch plan (every rank pads the kept counts all-gathered in
  // DropOverCapacity the same way, so all hold the same A).
  std::vector<int64_t> padded(E);
  w.expert_offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    padded[e] = RoundUp(w.kept_counts[e], config_.align_size);
    w.expert_offsets[e + 1] = w.expert_offsets[e] + padded[e];
  }
  std::vector<int64_t> counts_matrix;
  if (ranks_ == 1) {
    counts_matrix = padded;
  } else {
    counts_matrix.resize(ranks_ * E);
    for (int64_t i = 0; i < ranks_ * E; ++i) {
      counts_matrix[i] = RoundUp(w.all_kept_counts[i], config_.align_size);
    }
  }
  RETURN_IF_ERROR(CheckRowCounts(counts_matrix, ranks_, E));
  ASSIGN_OR_RETURN(s.plan, BuildDispatchPlan(counts_matrix, ranks_, rank_, E));
  if (s.plan.local_rows != w.expert_offsets[E]) {
    return absl::InternalError("all-gathered row counts disagree with this rank's own");
  }
  return absl::OkStatus();
}

absl::Status MoeLayerImpl::PermuteAndDispatch(SavedStep& s, ForwardWork& w) {
  const int64_t T = s.tokens, H = config_.hidden, E = config_.num_experts, K = config_.top_k;
  const DType cd = ExpertRowDType(config_);
  const size_t cs = DTypeSize(cd);
  const DispatchPlan& plan = s.plan;
  // 8. Permute: local layout [e0 rows | e1 rows | ...] with zero padding rows.
  ASSIGN_OR_RETURN(Buffer offsets_dev, Upload(w.expert_offsets.data(), (E + 1) * sizeof(int64_t)));
  ASSIGN_OR_RETURN(s.pair_row, backend_->Allocate(T * K * sizeof(int32_t)));
  ASSIGN_OR_RETURN(Buffer row_token, backend_->Allocate(plan.local_rows * sizeof(int32_t)));
  {
    PermuteArgs p;
    p.tokens = T, p.top_k = K, p.num_experts = E, p.total_rows = plan.local_rows;
    p.topk_expert = s.topk_expert.as<int32_t>();
    p.kept = w.kept.as<uint8_t>();
    p.expert_offsets = offsets_dev.as<int64_t>();
    p.pair_row = s.pair_row.as<int32_t>();
    p.row_token = row_token.as<int32_t>();
    RETURN_IF_ERROR(backend_->Permute(p));
  }
  ASSIGN_OR_RETURN(Buffer x_local, backend_->Allocate(plan.local_rows * H * cs));
  RETURN_IF_ERROR(backend_->ScatterTokenRows(w.x_experts, s.pair_row.as<int32_t>(), T, K,
                                             row_token.as<int32_t>(), plan.local_rows, H, cd,
                                             x_local.data()));
  // 9. Dispatch to the owners, expert layout (one rank: already is).
  if (DispatchIsIdentity(plan)) {
    s.x_expert = std::move(x_local);
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(s.x_expert, backend_->Allocate(plan.expert_rows * H * cs));
  return DispatchRows(backend_, comm_, plan, x_local.data(), s.x_expert.data(), H * cs);
}

absl::StatusOr<Tensor> MoeLayerImpl::CombineOutput(SavedStep& s, ForwardWork& w, Tensor* into) {
  const int64_t T = s.tokens, H = config_.hidden, K = config_.top_k;
  const DType cd = ExpertRowDType(config_);
  const size_t cs = DTypeSize(cd);
  const DispatchPlan& plan = s.plan;
  // 11. Combine: back to the local layout, then the weighted sum in slot order (fp32).
  if (DispatchIsIdentity(plan)) {
    s.y_local = std::move(w.y_expert);
  } else {
    ASSIGN_OR_RETURN(s.y_local, backend_->Allocate(plan.local_rows * H * cs));
    RETURN_IF_ERROR(ReturnRows(backend_, comm_, plan, w.y_expert.data(), s.y_local.data(), H * cs));
    w.y_expert.Reset();
  }
  ASSIGN_OR_RETURN(Buffer out, backend_->Allocate(T * H * DTypeSize(s.x_type)));
  RETURN_IF_ERROR(backend_->CombineRows(s.y_local.data(), cd, s.pair_row.as<int32_t>(),
                                        s.topk_weight.as<float>(), T, K, H, out.data(), s.x_type));
  return DownloadInto(out, s.x_type, {T, H}, into);
}

void MoeLayerImpl::AddLosses(const SavedStep& s, const ForwardWork& w, ForwardResult& result) {
  const LayerConfig& c = config_;
  const int64_t E = c.num_experts, K = c.top_k;
  // 5-6. The losses over the global token count.
  const double Tg = s.global_tokens;
  if (c.aux_loss_coeff > 0 && Tg > 0) {
    const double coeff = E * c.aux_loss_coeff / (K * Tg * Tg);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      sum += w.loss_sums[e] * static_cast<double>(s.global_counts[e]);
    }
    result.aux_loss = coeff * sum;
  }
  if (c.z_loss_coeff > 0 && Tg > 0) result.z_loss = c.z_loss_coeff / Tg * w.loss_sums[E];
  result.tokens_per_expert = s.global_counts;
  for (int64_t e = 0; e < E; ++e) accumulated_counts_[e] += s.global_counts[e];
}

}  // namespace moe
