// CudaBackend: the kernel entry points of engine/backend.h. Each checks its arguments on the
// host (before any allocation or launch), then enqueues launchers of kernels.cuh on the stream.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_backend_impl.h"
#include "engine/cuda/cuda_status.h"
#include "engine/status_macros.h"

namespace moe {
namespace cuda {
namespace {

absl::Status Invalid(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

absl::StatusOr<RouterParams> MakeRouterParams(const LayerConfig* c, int64_t tokens,
                                              const char* op) {
  if (c == nullptr) return Invalid(op, "config is null");
  if (tokens < 0) return Invalid(op, "negative token count");
  if (c->num_experts <= 0 || c->top_k <= 0 || c->top_k > c->num_experts) {
    return Invalid(op, "need 0 < top_k <= num_experts");
  }
  RouterParams p;
  p.tokens = tokens;
  p.num_experts = static_cast<int>(c->num_experts);
  p.top_k = static_cast<int>(c->top_k);
  p.sigmoid = c->score_function == ScoreFunction::kSigmoid;
  p.pre_softmax = c->pre_softmax;
  if (c->num_groups > 0 && c->group_topk > 0) {
    if (c->num_experts % c->num_groups != 0 || c->top_k % c->group_topk != 0 ||
        c->group_topk > c->num_groups) {
      return Invalid(op, "invalid grouped top-k configuration");
    }
    p.num_groups = static_cast<int>(c->num_groups);
    p.group_topk = static_cast<int>(c->group_topk);
  }
  p.scaling_factor = static_cast<float>(c->scaling_factor);
  return p;
}

}  // namespace

absl::Status CudaBackend::RouterForward(const RouterForwardArgs& a) {
  ASSIGN_OR_RETURN(RouterParams p, MakeRouterParams(a.config, a.tokens, "RouterForward"));
  if (a.expert_counts == nullptr || a.loss_partials == nullptr) {
    return Invalid("RouterForward", "expert_counts or loss_partials is null");
  }
  if (a.tokens > 0 && (a.logits == nullptr || a.topk_expert == nullptr ||
                       a.topk_weight == nullptr || a.scores == nullptr || a.logsumexp == nullptr)) {
    return Invalid("RouterForward", "null tensor");
  }
  if (a.expert_bias != nullptr && !p.sigmoid) {
    return Invalid("RouterForward", "expert_bias needs the sigmoid score function");
  }
  RETURN_IF_ERROR(Activate());
  ASSIGN_OR_RETURN(void* scratch, ScratchAlloc(RouterScratchBytes(a.tokens, p.num_experts)));
  CUDA_RETURN_IF_ERROR(LaunchRouterForward(p, a.logits, a.expert_bias, a.topk_expert, a.topk_weight,
                                           a.scores, a.logsumexp, a.expert_counts, a.loss_partials,
                                           scratch, stream_));
  return ScratchFree(scratch);
}

absl::Status CudaBackend::RouterBackward(const RouterBackwardArgs& a) {
  ASSIGN_OR_RETURN(RouterParams p, MakeRouterParams(a.config, a.tokens, "RouterBackward"));
  if (a.tokens == 0) return absl::OkStatus();
  if (a.logits == nullptr || a.scores == nullptr || a.logsumexp == nullptr ||
      a.topk_expert == nullptr || a.d_topk_weight == nullptr || a.d_logits == nullptr) {
    return Invalid("RouterBackward", "null tensor");
  }
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(LaunchRouterBackward(
      p, a.logits, a.scores, a.logsumexp, a.topk_expert, a.d_topk_weight, a.aux_grad,
      static_cast<float>(a.z_loss_grad_scale), a.d_logits, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::RoutePlan(const RoutePlanArgs& a) {
  if (a.tokens < 0 || a.top_k <= 0 || a.num_experts <= 0 || a.top_k > a.num_experts) {
    return Invalid("RoutePlan", "need tokens >= 0 and 0 < top_k <= num_experts");
  }
  if (a.kept_counts == nullptr) return Invalid("RoutePlan", "kept_counts is null");
  const int64_t pairs = a.tokens * a.top_k;
  if (pairs > 0 && (a.topk_expert == nullptr || a.kept == nullptr ||
                    (a.capacity >= 0 && a.topk_weight == nullptr))) {
    return Invalid("RoutePlan", "null tensor");
  }
  if (pairs > INT32_MAX) return Invalid("RoutePlan", "more than 2^31 pairs");
  RETURN_IF_ERROR(Activate());
  size_t scratch_bytes = 0;
  void* scratch = nullptr;
  if (a.capacity >= 0) {
    scratch_bytes = RoutePlanScratchBytes(pairs, static_cast<int>(a.num_experts));
    ASSIGN_OR_RETURN(scratch, ScratchAlloc(scratch_bytes));
  }
  CUDA_RETURN_IF_ERROR(LaunchRoutePlan(
      a.tokens, static_cast<int>(a.top_k), static_cast<int>(a.num_experts), a.capacity,
      a.topk_expert, a.topk_weight, a.kept, a.kept_counts, scratch, scratch_bytes, stream_));
  return ScratchFree(scratch);
}

absl::Status CudaBackend::Permute(const PermuteArgs& a) {
  if (a.tokens < 0 || a.top_k <= 0 || a.num_experts <= 0 || a.total_rows < 0) {
    return Invalid("Permute", "bad sizes");
  }
  const int64_t pairs = a.tokens * a.top_k;
  if (a.total_rows > INT32_MAX || pairs > INT32_MAX) {
    return Invalid("Permute", "more than 2^31 rows");
  }
  if ((pairs > 0 && (a.topk_expert == nullptr || a.kept == nullptr || a.pair_row == nullptr ||
                     a.expert_offsets == nullptr)) ||
      (a.total_rows > 0 && a.row_token == nullptr)) {
    return Invalid("Permute", "null tensor");
  }
  RETURN_IF_ERROR(Activate());
  ASSIGN_OR_RETURN(void* scratch,
                   ScratchAlloc(PermuteScratchBytes(pairs, static_cast<int>(a.num_experts))));
  CUDA_RETURN_IF_ERROR(LaunchPermute(
      a.tokens, static_cast<int>(a.top_k), static_cast<int>(a.num_experts), a.total_rows,
      a.topk_expert, a.kept, a.expert_offsets, a.pair_row, a.row_token, scratch, stream_));
  return ScratchFree(scratch);
}

absl::Status CudaBackend::GatherRows(const void* src, const int32_t* index, int64_t rows,
                                     int64_t width, DType dtype, void* dst) {
  if (rows < 0 || width < 0) return Invalid("GatherRows", "negative size");
  if (rows == 0 || width == 0) return absl::OkStatus();
  if (src == nullptr || index == nullptr || dst == nullptr) {
    return Invalid("GatherRows", "null pointer");
  }
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(LaunchGatherRows(src, index, rows, width * DTypeSize(dtype), dst, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::ScatterTokenRows(const void* src, const int32_t* pair_row, int64_t tokens,
                                           int64_t top_k, const int32_t* row_token, int64_t rows,
                                           int64_t width, DType dtype, void* dst) {
  const int64_t row_bytes = width * static_cast<int64_t>(DTypeSize(dtype));
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  // The token-side kernel needs 16-byte rows and int32 pair indices; otherwise gather.
  if (tokens < 0 || top_k <= 0 || rows < 0 || width < 0 || row_bytes % 16 != 0 || !aligned(src) ||
      !aligned(dst) || tokens * top_k > INT32_MAX) {
    return GatherRows(src, row_token, rows, width, dtype, dst);
  }
  if (rows == 0 || width == 0) return absl::OkStatus();  // no row to write (every pair dropped)
  if (src == nullptr || dst == nullptr || (tokens > 0 && pair_row == nullptr) ||
      (rows > 0 && row_token == nullptr)) {
    return Invalid("ScatterTokenRows", "null pointer");
  }
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(LaunchScatterTokenRows(src, pair_row, tokens, static_cast<int>(top_k),
                                              row_token, rows, row_bytes, dst, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyRowBlocks(const void* src, void* dst, size_t row_bytes,
                                        absl::Span<const RowBlock> blocks) {
  if (row_bytes == 0 || blocks.empty()) return absl::OkStatus();
  int64_t total_rows = 0;
  for (const RowBlock& b : blocks) {
    if (b.rows < 0 || b.src_row < 0 || b.dst_row < 0) {
      return Invalid("CopyRowBlocks", "negative row index");
    }
    total_rows += b.rows;
  }
  if (total_rows == 0) return absl::OkStatus();
  if (src == nullptr || dst == nullptr) return Invalid("CopyRowBlocks", "null pointer");
  RETURN_IF_ERROR(Activate());
  for (size_t first = 0; first < blocks.size(); first += kMaxTableBlocks) {
    RowBlockTable table;
    table.count = static_cast<int>(std::min<size_t>(kMaxTableBlocks, blocks.size() - first));
    for (int i = 0; i < table.count; ++i) {
      table.src_row[i] = blocks[first + i].src_row;
      table.dst_row[i] = blocks[first + i].dst_row;
      table.rows[i] = blocks[first + i].rows;
    }
    CUDA_RETURN_IF_ERROR(
        LaunchCopyRowBlocks(src, dst, static_cast<int64_t>(row_bytes), table, stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CombineRows(const void* y, DType y_type, const int32_t* pair_row,
                                      const float* weight, int64_t tokens, int64_t top_k,
                                      int64_t width, void* out, DType out_type) {
  if (tokens < 0 || top_k < 0 || width < 0) return Invalid("CombineRows", "negative size");
  if (!IsKernelType(y_type) || !IsKernelType(out_type)) return Invalid("CombineRows", "dtype");
  if (tokens == 0 || width == 0) return absl::OkStatus();
  // y may be null when every pair was dropped (no rows at all).
  if (out == nullptr || (top_k > 0 && pair_row == nullptr)) {
    return Invalid("CombineRows", "null pointer");
  }
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(LaunchCombineRows(y, ToKType(y_type), pair_row, weight, tokens,
                                         static_cast<int>(top_k), width, out, ToKType(out_type),
                                         stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::CombineBackward(const void* d_out, DType d_out_type, const void* y,
                                          DType y_type, const int32_t* pair_row,
                                          const float* weight, int64_t tokens, int64_t top_k,
                                          int64_t width, int64_t total_rows, void* d_y,
                                          float* d_weight) {
  if (tokens < 0 || top_k < 0 || width < 0 || total_rows < 0) {
    return Invalid("CombineBackward", "negative size");
  }
  if (!IsKernelType(y_type) || !IsKernelType(d_out_type)) {
    return Invalid("CombineBackward", "dtype");
  }
  // y may be null when there are no rows (every pair dropped).
  if ((total_rows > 0 && width > 0 && (d_y == nullptr || y == nullptr)) ||
      (tokens > 0 && top_k > 0 &&
       (d_out == nullptr || pair_row == nullptr || d_weight == nullptr))) {
    return Invalid("CombineBackward", "null pointer");
  }
  RETURN_IF_ERROR(Activate());
  if (total_rows > 0 && width > 0) {
    RETURN_IF_ERROR(Memset(d_y, 0, total_rows * width * DTypeSize(y_type)));
  }
  if (tokens == 0 || top_k == 0) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(LaunchCombineBackward(d_out, ToKType(d_out_type), y, ToKType(y_type),
                                             pair_row, weight, tokens, static_cast<int>(top_k),
                                             width, d_y, d_weight, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::ActivationForward(const ActivationArgs& a) {
  if (a.rows < 0 || a.ffn < 0) return Invalid("ActivationForward", "negative size");
  if (!IsKernelType(a.dtype)) return Invalid("ActivationForward", "dtype");
  if (a.rows == 0 || a.ffn == 0) return absl::OkStatus();
  if (a.h == nullptr || a.a == nullptr) return Invalid("ActivationForward", "null pointer");
  const int64_t up = a.gated ? 2 * a.ffn : a.ffn;
  if (a.up_bias != nullptr)
    RETURN_IF_ERROR(AddGroupBias(a.h, a.dtype, a.up_bias, up, a.group_rows));
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(LaunchActivationForward(static_cast<ActKind>(a.activation), a.gated, a.rows,
                                               a.ffn, ToKType(a.dtype), a.h, a.a, a.amax, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::ActivationBackward(const ActivationArgs& a) {
  if (a.rows < 0 || a.ffn < 0) return Invalid("ActivationBackward", "negative size");
  if (!IsKernelType(a.dtype)) return Invalid("ActivationBackward", "dtype");
  if (a.rows == 0 || a.ffn == 0) return absl::OkStatus();
  if (a.h == nullptr || a.d_a == nullptr || a.d_h == nullptr) {
    return Invalid("ActivationBackward", "null pointer");
  }
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(LaunchActivationBackward(static_cast<ActKind>(a.activation), a.gated, a.rows,
                                                a.ffn, ToKType(a.dtype), a.h, a.d_a, a.d_h, a.amax,
                                                stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::AddGroupBias(void* y, DType dtype, const float* bias, int64_t width,
                                       GroupRows group_rows) {
  if (width < 0) return Invalid("AddGroupBias", "negative width");
  if (!IsKernelType(dtype)) return Invalid("AddGroupBias", "dtype");
  for (int64_t r : group_rows) {
    if (r < 0) return Invalid("AddGroupBias", "negative group rows");
  }
  if (width == 0 || group_rows.empty()) return absl::OkStatus();
  if (y == nullptr || bias == nullptr) return Invalid("AddGroupBias", "null pointer");
  RETURN_IF_ERROR(Activate());
  for (const GroupTable& t : MakeGroupTables(group_rows)) {
    CUDA_RETURN_IF_ERROR(
        LaunchAddGroupBias(y, ToKType(dtype), bias + t.first_group * width, width, t, stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::GroupBiasGrad(const void* d_y, DType dtype, int64_t width,
                                        GroupRows group_rows, float* d_bias) {
  if (width < 0) return Invalid("GroupBiasGrad", "negative width");
  if (!IsKernelType(dtype)) return Invalid("GroupBiasGrad", "dtype");
  for (int64_t r : group_rows) {
    if (r < 0) return Invalid("GroupBiasGrad", "negative group rows");
  }
  if (width == 0 || group_rows.empty()) return absl::OkStatus();
  if (d_bias == nullptr) return Invalid("GroupBiasGrad", "null pointer");
  RETURN_IF_ERROR(Activate());
  for (const GroupTable& t : MakeGroupTables(group_rows)) {
    CUDA_RETURN_IF_ERROR(LaunchGroupBiasGrad(d_y, ToKType(dtype), width, t,
                                             d_bias + t.first_group * width, stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::OptimizerStep(const OptimizerArgs& a, float* param, const float* grad,
                                        float* state1, float* state2, int64_t count) {
  if (count < 0) return Invalid("OptimizerStep", "negative count");
  if (count == 0) return absl::OkStatus();
  if (param == nullptr || grad == nullptr) return Invalid("OptimizerStep", "null pointer");
  OptimizerParams p;
  p.adamw = a.adamw;
  p.lr = static_cast<float>(a.lr);
  p.momentum = static_cast<float>(a.momentum);
  p.beta1 = static_cast<float>(a.beta1);
  p.beta2 = static_cast<float>(a.beta2);
  p.eps = static_cast<float>(a.eps);
  p.weight_decay = static_cast<float>(a.weight_decay);
  p.grad_scale = static_cast<float>(a.grad_scale);
  if (a.adamw) {
    if (state1 == nullptr || state2 == nullptr) {
      return Invalid("OptimizerStep", "AdamW needs both moment buffers");
    }
    if (a.step < 1) return Invalid("OptimizerStep", "AdamW step counts from 1");
    p.bias_correction1 = static_cast<float>(1.0 - std::pow(a.beta1, static_cast<double>(a.step)));
    p.bias_correction2 = static_cast<float>(1.0 - std::pow(a.beta2, static_cast<double>(a.step)));
  } else if (a.momentum != 0.0 && state1 == nullptr) {
    return Invalid("OptimizerStep", "SGD momentum needs a state buffer");
  }
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(
      LaunchOptimizerStep(p, param, grad, state1, a.adamw ? state2 : nullptr, count, stream_));
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace moe
