// The Backend seam: where a layer's tensors live and the kernels of one MoE step.
//
// The step itself (engine/moe_layer_forward.cc and moe_layer_backward.cc) is written once
// against this interface; the CPU backend (engine/cpu/) and the CUDA backend (engine/cuda/)
// implement it. Every pointer passed to a kernel below is memory of this backend (host memory
// for the CPU backend, device memory for CUDA) unless its comment says "host". Kernels are
// enqueued in order on the backend's one stream and may run asynchronously; only CopyToHost
// and Synchronize wait.
// No CUDA type appears here: the CUDA stream is handed around as an opaque pointer.
//
//   std::unique_ptr<Backend> backend = MakeCpuBackend();
//   ASSIGN_OR_RETURN(Buffer logits, backend->Allocate(tokens * experts * sizeof(float)));
//   RETURN_IF_ERROR(backend->Gemm({...}));
#ifndef MOED_ENGINE_BACKEND_H_
#define MOED_ENGINE_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "engine/config.h"
#include "engine/dtype.h"

namespace moe {

enum class MemorySpace { kHost, kDevice };

// Memory owned by a backend. Move-only; frees itself through its backend's deleter.
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* data, size_t bytes, std::function<void(void*)> deleter)
      : data_(data), bytes_(bytes), deleter_(std::move(deleter)) {}
  ~Buffer() { Reset(); }
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = other.data_;
      bytes_ = other.bytes_;
      deleter_ = std::move(other.deleter_);
      other.data_ = nullptr;
      other.bytes_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  void Reset() {
    if (data_ != nullptr && deleter_) deleter_(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> deleter_;
};

// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C, all row-major, fp32 accumulation.
// op(A) = A ([m, k], lda >= k) or, with trans_a, A^T where A is [k, m] (lda >= m); same for B.
// ab_type: kFloat32 or kBFloat16 (A and B alike); c_type: kFloat32 or kBFloat16.
// m, n or k may be 0 (then C is scaled by beta, or left alone when m or n is 0).
// FP8 operands (compute_dtype = FP8, docs/SPEC.md "FP8"): a_fp8 and b_fp8 set to kFloat8E4M3 or
// kFloat8E5M2 (not both e5m2) instead of ab_type, with a_scale / b_scale (backend memory, one
// float each, 16-byte aligned: cuBLASLt refuses others) their dequantisation scales:
// C = alpha * (a_scale * b_scale) * A . B^T + beta C.
// Only this "TN" shape: trans_a false, trans_b true (both operands contiguous along k, as
// Hopper's FP8 tensor cores need).
// a_bf16 (optional, fp32 GEMMs only): the same A, value for value, as bf16 (same layout and
// lda), for a caller whose fp32 A is the exact widening of bf16 data (the router's x when x
// came as BF16). The result is still the fp32 GEMM's; a backend may read a_bf16 instead of a
// (the CUDA backend then runs the GEMM on bf16 tensor cores: engine/cuda/bf16_split.h), and a
// may then be null (Backend::GemmReadsBf16A; the CPU backend widens a_bf16 when a is null and
// otherwise reads a).
struct GemmArgs {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  DType ab_type = DType::kFloat32;
  DType c_type = DType::kFloat32;
  float alpha = 1.0f;
  float beta = 0.0f;
  DType a_fp8 = DType::kFloat32;  // kFloat32 = not FP8 (ab_type applies)
  DType b_fp8 = DType::kFloat32;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  const void* a_bf16 = nullptr;
  bool is_fp8() const { return a_fp8 != DType::kFloat32; }
};

// Current per-tensor scaling to FP8 (docs/SPEC.md "FP8"). For each of `batch` matrices
// src_b = src + b * rows * cols ([rows, cols] row-major, FP32 or BF16):
//   amax_b  = max |src_b| (NaN ignored), computed on the backend;
//   scale_b = Fp8Scale(amax_b, fp8) (engine/fp8.h), written to scale[b] (backend memory);
//   dst_b   = FloatToFp8(src_b / scale_b, fp8), [rows, cols] or, with `transpose`, [cols, rows].
// Every backend writes bitwise the same codes and scales.
//
// Grouped transposed codes (batch 1, the FP8 weight-gradient GEMMs, whose k is a group's row
// count): with dst_grouped_t set, the same codes are also written to dst_grouped_t
// [cols, Fp8GroupedColumns(group_rows)] row-major. Row r of group g (rows
// [row_start_g, row_start_g + group_rows[g]), row_start_g = sum of the groups before g) goes to
// column col_start_g + (r - row_start_g), col_start_g = sum over the groups before g of
// RoundUp(group_rows[g'], kFp8GroupAlign); the pad columns after each group are zero codes, so
// that a GEMM over a group's padded columns sums the group's rows only:
//   [c0: g0 r0..r(n0-1) 0..0 | g1 ... ]   [c1: ...]   (each group starts 16-byte aligned)
// dst may then be null (only this layout is written).
struct QuantizeArgs {
  const void* src = nullptr;
  DType src_type = DType::kBFloat16;
  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;
  bool transpose = false;
  DType fp8 = DType::kFloat8E4M3;
  void* dst = nullptr;     // batch * rows * cols bytes
  float* scale = nullptr;  // matrix b's scale at scale[b * scale_stride]
  // kFp8ScaleStride keeps every matrix's scale 16-byte aligned, as an FP8 GEMM needs it.
  int64_t scale_stride = 1;
  void* dst_grouped_t = nullptr;         // optional, see above (batch 1, transpose false)
  absl::Span<const int64_t> group_rows;  // host; sums to rows (with dst_grouped_t only)
  // Optional (batch 1): the amax the scale comes from (backend memory), so the quantisation
  // skips its own amax pass: max |src| already computed by the kernel that wrote src
  // (ActivationArgs::amax, current scaling) or the delayed scaling's Fp8HistoryAmax.
  const float* amax = nullptr;
  // Optional (batch 1, delayed scaling): *amax_out = max(*amax_out, max |src|) (NaN ignored),
  // reduced by the kernel that writes the codes while it reads src: this step's amax for the
  // history, without another pass.
  float* amax_out = nullptr;
};

// Delayed FP8 scaling (docs/SPEC.md "FP8", "Delayed scaling"): one tensor's amax history
// `history` [len] (backend memory), a ring of which slot i % len holds step i's amax and
// min(steps, len) slots are filled. Fp8HistoryAmax writes to *amax the amax this step's
// scale comes from,
//   ldexp(A, margin), A = max of the filled slots (most_recent: slot (steps - 1) % len;
//   either is 0 when steps == 0), in fp32 (an overflow gives +inf, hence scale 1),
// and then zeroes slot steps % len, where this step's amax is reduced (amax_out,
// ActivationArgs::amax). Every backend writes bitwise the same value (engine/fp8.h
// Fp8DelayedAmax).
struct Fp8HistoryArgs {
  float* history = nullptr;
  int64_t len = 0;    // >= 1
  int64_t steps = 0;  // steps recorded so far, >= 0
  int margin = 0;     // 0..kMaxFp8Margin
  bool most_recent = false;
  float* amax = nullptr;  // one float (backend memory)
};

// Floats between per-matrix FP8 scales that FP8 GEMMs read one by one (16 bytes).
inline constexpr int64_t kFp8ScaleStride = 4;

// Codes (columns) each group of QuantizeArgs::dst_grouped_t starts on a multiple of: Hopper's
// FP8 GEMMs want 16-byte aligned operands and leading dimensions.
inline constexpr int64_t kFp8GroupAlign = 16;

// A group's padded width in dst_grouped_t: group_rows rounded up to kFp8GroupAlign.
inline int64_t Fp8PaddedRows(int64_t group_rows) {
  return (group_rows + kFp8GroupAlign - 1) / kFp8GroupAlign * kFp8GroupAlign;
}

// The columns (leading dimension) of dst_grouped_t: the sum of the groups' padded widths.
inline int64_t Fp8GroupedColumns(absl::Span<const int64_t> group_rows) {
  int64_t columns = 0;
  for (int64_t rows : group_rows) columns += Fp8PaddedRows(rows);
  return columns;
}

// The preconditions of QuantizeArgs that every backend shares (a backend may add its own
// limits): an FP8 format, an FP32 or BF16 source, sizes >= 0, scale_stride >= 1, a given amax
// only with batch 1, the pointers a non-empty batch writes through, and for dst_grouped_t batch
// 1, not transposed, group_rows >= 0 summing to rows. INVALID_ARGUMENT naming the first broken.
inline absl::Status CheckQuantizeArgs(const QuantizeArgs& q) {
  if (q.fp8 != DType::kFloat8E4M3 && q.fp8 != DType::kFloat8E5M2) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeFp8: fp8 must be FP8_E4M3 or FP8_E5M2, got ", DTypeName(q.fp8)));
  }
  if (q.src_type != DType::kFloat32 && q.src_type != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeFp8: src_type must be FP32 or BF16, got ", DTypeName(q.src_type)));
  }
  if (q.batch < 0 || q.rows < 0 || q.cols < 0) {
    return absl::InvalidArgumentError("QuantizeFp8: negative size");
  }
  if (q.scale_stride < 1) return absl::InvalidArgumentError("QuantizeFp8: scale_stride < 1");
  if ((q.amax != nullptr || q.amax_out != nullptr) && q.batch != 1) {
    return absl::InvalidArgumentError("QuantizeFp8: a given amax or amax_out needs batch 1");
  }
  const bool grouped = q.dst_grouped_t != nullptr;
  if (q.batch > 0 &&
      (q.scale == nullptr ||
       (q.rows * q.cols > 0 && (q.src == nullptr || (q.dst == nullptr && !grouped))))) {
    return absl::InvalidArgumentError("QuantizeFp8: null src, dst or scale");
  }
  if (!grouped) return absl::OkStatus();
  if (q.batch != 1 || q.transpose) {
    return absl::InvalidArgumentError(
        "QuantizeFp8: dst_grouped_t needs batch 1 and transpose false");
  }
  int64_t rows = 0;
  for (int64_t r : q.group_rows) {
    if (r < 0) return absl::InvalidArgumentError("QuantizeFp8: negative group_rows");
    rows += r;
  }
  if (rows != q.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeFp8: group_rows sum to ", rows, ", not rows = ", q.rows));
  }
  return absl::OkStatus();
}

// The preconditions of Fp8HistoryArgs every backend shares: INVALID_ARGUMENT naming the first
// broken (a null pointer, len < 1, steps < 0, margin outside 0..kMaxFp8Margin).
inline absl::Status CheckFp8HistoryArgs(const Fp8HistoryArgs& h) {
  if (h.history == nullptr || h.amax == nullptr) {
    return absl::InvalidArgumentError("Fp8HistoryAmax: null history or amax");
  }
  if (h.len < 1 || h.steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Fp8HistoryAmax: len ", h.len, " < 1 or steps ", h.steps, " < 0"));
  }
  if (h.margin < 0 || h.margin > kMaxFp8Margin) {
    return absl::InvalidArgumentError(
        absl::StrCat("Fp8HistoryAmax: margin ", h.margin, " outside [0, ", kMaxFp8Margin, "]"));
  }
  return absl::OkStatus();
}

// Router forward over this rank's tokens (docs/SPEC.md Forward 1-6 without the collectives).
// Slot order: the k selected experts of a token in descending selection score, ties toward the
// lower expert index. That order defines "slot j" everywhere (permute, combine, backward).
struct RouterForwardArgs {
  const LayerConfig* config = nullptr;
  int64_t tokens = 0;
  const float* logits = nullptr;       // [T, E] z = x . gate
  const float* expert_bias = nullptr;  // [E] or nullptr (sigmoid only)
  int32_t* topk_expert = nullptr;      // out [T, k]
  float* topk_weight = nullptr;        // out [T, k] probs = scaling_factor * p
  float* scores = nullptr;             // out [T, E] softmax(z) (softmax) or sigmoid(z) (sigmoid)
  float* logsumexp = nullptr;          // out [T] logsumexp(z_t)
  int32_t* expert_counts = nullptr;    // out [E] (token, slot) pairs routed to e, before drops
  // out [E + 1], fp64: [0, E) = sum over tokens of the aux probability P[t, e] (SPEC Forward 5),
  // [E] = sum over tokens of logsumexp(z_t)^2 (z-loss numerator).
  double* loss_partials = nullptr;
};

struct RouterBackwardArgs {
  const LayerConfig* config = nullptr;
  int64_t tokens = 0;
  const float* logits = nullptr;         // [T, E]
  const float* scores = nullptr;         // [T, E] as saved by RouterForward
  const float* logsumexp = nullptr;      // [T]
  const int32_t* topk_expert = nullptr;  // [T, k]
  const float* d_topk_weight = nullptr;  // [T, k] d_probs from the combine backward
  // [E] or nullptr: dL/dP[t, e] for the aux loss, C * f_e * d_aux (the same for every t).
  const float* aux_grad = nullptr;
  double z_loss_grad_scale = 0.0;        // d_zl * z_loss_coeff / T_g (0 = no z-loss term)
  float* d_logits = nullptr;             // out [T, E] (overwritten)
};

// Capacity and permutation plan (docs/SPEC.md Forward 7-8).
struct RoutePlanArgs {
  int64_t tokens = 0;
  int64_t top_k = 0;
  int64_t num_experts = 0;
  int64_t capacity = -1;                 // pairs kept per expert, -1 = dropless
  const int32_t* topk_expert = nullptr;  // [T, k]
  const float* topk_weight = nullptr;    // [T, k]
  uint8_t* kept = nullptr;               // out [T, k]: 1 kept, 0 dropped
  int32_t* kept_counts = nullptr;        // out [E] pairs kept per expert
};

// Fills the permuted layout: pairs sorted stably by expert (ties by token, then slot); expert
// e's rows start at expert_offsets[e] (padding rows after its kept pairs, up to the next offset).
struct PermuteArgs {
  int64_t tokens = 0;
  int64_t top_k = 0;
  int64_t num_experts = 0;
  int64_t total_rows = 0;                  // expert_offsets[E]
  const int32_t* topk_expert = nullptr;    // [T, k]
  const uint8_t* kept = nullptr;           // [T, k]
  const int64_t* expert_offsets = nullptr; // [E + 1] (backend memory)
  int32_t* pair_row = nullptr;             // out [T, k] permuted row of (t, j), -1 if dropped
  int32_t* row_token = nullptr;            // out [total_rows] source token, -1 on padding rows
};

// A run of contiguous rows moved by the dispatch reorder (rows are `row_bytes` wide).
struct RowBlock {
  int64_t src_row = 0;
  int64_t dst_row = 0;
  int64_t rows = 0;
};

// Rows of the expert FFN belonging to each local expert, in order (host memory).
using GroupRows = absl::Span<const int64_t>;

struct ActivationArgs {
  Activation activation = Activation::kSilu;
  bool gated = true;
  int64_t rows = 0;
  int64_t ffn = 0;          // F
  DType dtype = DType::kFloat32;  // of h, a, d_a, d_h
  void* h = nullptr;        // [rows, up] up = 2F gated else F; forward adds up_bias in place
  void* a = nullptr;        // [rows, F] forward output
  const void* d_a = nullptr;  // [rows, F] backward input
  void* d_h = nullptr;      // [rows, up] backward output
  const float* up_bias = nullptr;  // [groups, up] or nullptr
  GroupRows group_rows;     // rows of each local expert (needed when up_bias is set)
  // Optional (FP8, docs/SPEC.md "FP8"): max(*amax, max |output as stored|) (a forward, d_h
  // backward; NaN ignored) is written to *amax (backend memory, zeroed by the caller first):
  // the amax a QuantizeFp8 of the output would compute, for QuantizeArgs::amax.
  float* amax = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;  // "cpu", "cuda:0"
  virtual MemorySpace memory_space() const = 0;
  // OK when this backend can run the layer's compute dtype (FP8 needs FP8 tensor cores on
  // CUDA); FAILED_PRECONDITION saying why not otherwise. MoeLayer::Create asks first.
  virtual absl::Status CheckComputeDType(const LayerConfig& config) const {
    (void)config;
    return absl::OkStatus();
  }
  // fp8_gemms = AUTO (engine/fp8_gemms.h): whether this GEMM at this layer shape runs faster
  // with FP8 operands than in bf16 on this backend, by its measurements (CUDA: the table of
  // engine/cuda/fp8_gemm_table.h; the CPU emulation: CpuFp8GemmPays). Must be a pure function
  // of the shape and the device kind, so every rank and every rerun makes the same choice.
  // By default FP8 everywhere.
  virtual bool Fp8GemmPays(const Fp8GemmShape& shape) const {
    (void)shape;
    return true;
  }
  // The CUDA stream (cudaStream_t) for the NCCL communicator; nullptr on the CPU.
  virtual void* stream() const { return nullptr; }

  // ---- memory ----
  virtual absl::StatusOr<Buffer> Allocate(size_t bytes) = 0;  // contents undefined
  virtual absl::Status CopyFromHost(void* dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;  // waits
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Memset(void* dst, int value, size_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;
  // Bytes currently allocated through this backend and the peak since creation (telemetry).
  virtual size_t allocated_bytes() const = 0;
  virtual size_t peak_allocated_bytes() const = 0;

  // ---- dense math ----
  virtual absl::Status Gemm(const GemmArgs& args) = 0;
  // True when Gemm reads GemmArgs::a_bf16, where given, instead of a: a may then be null (the
  // layer keeps no fp32 copy of a BF16 x for the router). False: a must always be given.
  // No default: a wrapping backend must pass its inner backend's answer on.
  virtual bool GemmReadsBf16A() const = 0;
  // Independent GEMMs (one per local expert); the CUDA backend batches or overlaps them.
  // Their a_bf16 must be null (it is for Gemm): INVALID_ARGUMENT, before any runs, otherwise.
  virtual absl::Status GroupedGemm(absl::Span<const GemmArgs> gemms) {
    for (const GemmArgs& g : gemms) {
      if (g.a_bf16 != nullptr) return absl::InvalidArgumentError("GroupedGemm: a_bf16 is for Gemm");
    }
    for (const GemmArgs& g : gemms) {
      absl::Status s = Gemm(g);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // FP8 quantisation with a per-tensor scale (QuantizeArgs above).
  virtual absl::Status QuantizeFp8(const QuantizeArgs& args) = 0;
  // Delayed scaling's amax from a history, and the history's next slot zeroed (above).
  virtual absl::Status Fp8HistoryAmax(const Fp8HistoryArgs& args) = 0;
  // dst[i] = src[i] converted (FP32 <-> BF16, or a copy).
  virtual absl::Status Convert(const void* src, DType src_type, void* dst, DType dst_type,
                               int64_t count) = 0;
  // dst[i] += src[i] (fp32).
  virtual absl::Status AddInPlace(float* dst, const float* src, int64_t count) = 0;

  // ---- router ----
  virtual absl::Status RouterForward(const RouterForwardArgs& args) = 0;
  virtual absl::Status RouterBackward(const RouterBackwardArgs& args) = 0;

  // ---- permutation, dispatch reorder, combine ----
  virtual absl::Status RoutePlan(const RoutePlanArgs& args) = 0;
  virtual absl::Status Permute(const PermuteArgs& args) = 0;
  // dst[r] = src[index[r]] (rows of `width` elements of `dtype`), zeros where index[r] < 0.
  virtual absl::Status GatherRows(const void* src, const int32_t* index, int64_t rows,
                                  int64_t width, DType dtype, void* dst) = 0;
  // Forward 8's permuted rows from the token side: dst[pair_row[t * top_k + j]] = src[t] for
  // every pair with pair_row >= 0, and zeros in every row r < rows with row_token[r] < 0.
  // With Permute's pair_row and row_token (inverse maps of each other) this is exactly
  // GatherRows(src, row_token, rows, ...), which the default runs; a backend may instead read
  // each token's row once rather than top_k times.
  virtual absl::Status ScatterTokenRows(const void* src, const int32_t* pair_row, int64_t tokens,
                                        int64_t top_k, const int32_t* row_token, int64_t rows,
                                        int64_t width, DType dtype, void* dst) {
    return GatherRows(src, row_token, rows, width, dtype, dst);
  }
  // Moves row blocks (host list) from src to dst; rows are row_bytes wide.
  virtual absl::Status CopyRowBlocks(const void* src, void* dst, size_t row_bytes,
                                     absl::Span<const RowBlock> blocks) = 0;
  // out[t] = sum over j in slot order of w[t, j] * y[pair_row[t, j]] (w == nullptr: weight 1),
  // accumulated in fp32, skipping pair_row < 0, written as out_type (FP32 or BF16).
  virtual absl::Status CombineRows(const void* y, DType y_type, const int32_t* pair_row,
                                   const float* weight, int64_t tokens, int64_t top_k,
                                   int64_t width, void* out, DType out_type) = 0;
  // Backward of CombineRows with weights: d_y[pair_row[t, j]] = w[t, j] * d_out[t] (rows no pair
  // points at are zeroed; d_y has total_rows rows), d_w[t, j] = <d_out[t], y[pair_row[t, j]]>
  // in fp32 (0 for dropped pairs).
  virtual absl::Status CombineBackward(const void* d_out, DType d_out_type, const void* y,
                                       DType y_type, const int32_t* pair_row, const float* weight,
                                       int64_t tokens, int64_t top_k, int64_t width,
                                       int64_t total_rows, void* d_y, float* d_weight) = 0;

  // ---- expert FFN pieces ----
  virtual absl::Status ActivationForward(const ActivationArgs& args) = 0;
  virtual absl::Status ActivationBackward(const ActivationArgs& args) = 0;
  // y[r, :] += bias[g, :] for the rows of group g (y of dtype, bias fp32 [groups, width]).
  virtual absl::Status AddGroupBias(void* y, DType dtype, const float* bias, int64_t width,
                                    GroupRows group_rows) = 0;
  // d_bias[g, :] += sum over the rows of group g of d_y (fp32 accumulation, fixed order).
  virtual absl::Status GroupBiasGrad(const void* d_y, DType dtype, int64_t width,
                                     GroupRows group_rows, float* d_bias) = 0;

  // ---- optimizers (fp32 masters) ----
  // SGD: m = momentum * m + g (+ wd * p); p -= lr * m (momentum 0: plain step).
  // AdamW: m, v moments; p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p); `step` counts from 1.
  // g is the stored gradient times grad_scale (data-parallel mean over ranks; 1: as stored).
  struct OptimizerArgs {
    bool adamw = false;
    double lr = 0, momentum = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
    double grad_scale = 1;
    int64_t step = 1;
  };
  virtual absl::Status OptimizerStep(const OptimizerArgs& args, float* param, const float* grad,
                                     float* state1, float* state2, int64_t count) = 0;
  // *all_finite = no element of data[0, count) (backend memory) is NaN or +-Inf: the check
  // before an optimizer step (MoeLayer::NonFiniteGradient). The default copies 4 MiB pieces
  // to the host and scans them (any backend); the CPU backend reads its memory directly.
  virtual absl::Status AllFinite(const float* data, int64_t count, bool* all_finite);
};

// The expert GEMMs a layer of `config` runs on FP8 operands on `backend` (MoeLayer::
// fp8_gemms): none unless compute_dtype is FP8; then config.fp8_gemms' set, all six (ALL), or
// under AUTO those Backend::Fp8GemmPays says win at the layer's shape.
Fp8GemmSet ResolveFp8Gemms(const LayerConfig& config, const Backend& backend);

}  // namespace moe

#endif  // MOED_ENGINE_BACKEND_H_
