// Plain-pointer launcher API of the CUDA backend's kernels (DeepEP api.cuh style).
//
// No CUDA type appears here, so host code that only orchestrates (engine/cuda/cuda_backend.cc)
// and its tests can include this file with any C++ compiler. Every launcher enqueues its
// kernels on `stream` (a cudaStream_t passed as void*), never synchronises, and returns the
// launch's cudaError_t as an int (0 = success). Every pointer is device memory unless its
// comment says "host". Layouts are row-major; "pair" (t, j) means token t's slot j, stored
// at index t * k + j of a [T, k] array.
//
//   int err = moe::cuda::LaunchConvert(src, KType::kF32, dst, KType::kBF16, n, stream);
#ifndef MOED_ENGINE_CUDA_KERNELS_CUH_
#define MOED_ENGINE_CUDA_KERNELS_CUH_

#include <cstddef>
#include <cstdint>

namespace moe {
namespace cuda {

// Element types the kernels handle (engine DType kFloat32 / kBFloat16).
enum class KType : int { kF32 = 0, kBF16 = 1 };

// Kernel parameter tables passed by value (no host-to-device copy, no sync). Launchers split
// longer host lists into several launches.
constexpr int kMaxTableGroups = 512;
struct GroupTable {
  int count = 0;                          // groups in this launch
  int64_t first_group = 0;                // index of groups[0] in the caller's list
  int64_t start[kMaxTableGroups + 1] = {};  // row offsets; group g owns [start[g], start[g+1])
};
constexpr int kMaxTableBlocks = 400;
struct RowBlockTable {
  int count = 0;
  int64_t src_row[kMaxTableBlocks] = {};
  int64_t dst_row[kMaxTableBlocks] = {};
  int64_t rows[kMaxTableBlocks] = {};
};

// ---- router (router_kernels.cu) ----
struct RouterParams {
  int64_t tokens = 0;
  int num_experts = 0;
  int top_k = 0;
  bool sigmoid = false;      // score function
  bool pre_softmax = false;  // softmax only
  int num_groups = 0;        // grouped top-k off when 0
  int group_topk = 0;
  float scaling_factor = 1.0f;
};
// Fills topk_expert/topk_weight/scores/logsumexp, expert_counts [E] and loss_partials [E+1]
// (fp64). `scratch` holds T floats (per-token sum of sigmoid scores) + partial sums; size it
// with RouterScratchBytes.
size_t RouterScratchBytes(int64_t tokens, int num_experts);
int LaunchRouterForward(const RouterParams& p, const float* logits, const float* expert_bias,
                        int32_t* topk_expert, float* topk_weight, float* scores,
                        float* logsumexp, int32_t* expert_counts, double* loss_partials,
                        void* scratch, void* stream);
int LaunchRouterBackward(const RouterParams& p, const float* logits, const float* scores,
                         const float* logsumexp, const int32_t* topk_expert,
                         const float* d_topk_weight, const float* aux_grad,
                         float z_loss_grad_scale, float* d_logits, void* stream);

// ---- plan / permute / combine (permute_kernels.cu) ----
// Temporary device bytes RoutePlan and Permute need (allocated by the caller).
size_t RoutePlanScratchBytes(int64_t pairs, int num_experts);
int LaunchRoutePlan(int64_t tokens, int top_k, int num_experts, int64_t capacity,
                    const int32_t* topk_expert, const float* topk_weight, uint8_t* kept,
                    int32_t* kept_counts, void* scratch, size_t scratch_bytes, void* stream);
size_t PermuteScratchBytes(int64_t pairs, int num_experts);
int LaunchPermute(int64_t tokens, int top_k, int num_experts, int64_t total_rows,
                  const int32_t* topk_expert, const uint8_t* kept, const int64_t* expert_offsets,
                  int32_t* pair_row, int32_t* row_token, void* scratch, void* stream);
int LaunchGatherRows(const void* src, const int32_t* index, int64_t rows, int64_t row_bytes,
                     void* dst, void* stream);
// dst[pair_row[t * top_k + j]] = src[t] (pair_row >= 0), zero rows where row_token < 0. Needs
// row_bytes % 16 == 0 and 16-byte aligned src and dst (else cudaErrorInvalidValue; the caller
// gathers instead).
int LaunchScatterTokenRows(const void* src, const int32_t* pair_row, int64_t tokens, int top_k,
                           const int32_t* row_token, int64_t rows, int64_t row_bytes, void* dst,
                           void* stream);
int LaunchCopyRowBlocks(const void* src, void* dst, int64_t row_bytes,
                        const RowBlockTable& table, void* stream);
int LaunchCombineRows(const void* y, KType y_type, const int32_t* pair_row, const float* weight,
                      int64_t tokens, int top_k, int64_t width, void* out, KType out_type,
                      void* stream);
// d_y must be zeroed by the caller first (rows no pair points at stay zero).
int LaunchCombineBackward(const void* d_out, KType d_out_type, const void* y, KType y_type,
                          const int32_t* pair_row, const float* weight, int64_t tokens,
                          int top_k, int64_t width, void* d_y, float* d_weight, void* stream);

// ---- elementwise (elementwise_kernels.cu) ----
enum class ActKind : int { kSilu = 0, kGelu = 1, kRelu = 2, kLinear = 3 };
// Forward: a = act(g) * u (gated: h = [g | u], [rows, 2F]) or a = act(h) ([rows, F]).
// Backward: d_h = [d_a * u * act'(g) | d_a * act(g)] or d_a * act'(h). Up-projection biases
// are added to h beforehand with LaunchAddGroupBias. amax (nullable; a zeroed float, or a
// previous max): max |output as stored| is atomically maxed into it (engine/backend.h
// ActivationArgs::amax).
int LaunchActivationForward(ActKind act, bool gated, int64_t rows, int64_t ffn, KType type,
                            const void* h, void* a, float* amax, void* stream);
int LaunchActivationBackward(ActKind act, bool gated, int64_t rows, int64_t ffn, KType type,
                             const void* h, const void* d_a, void* d_h, float* amax,
                             void* stream);
// y[r, :] += bias[g, :] for the rows of each group of the table (bias points at the table's
// first group). GroupBiasGrad: d_bias[g, :] += sum over group g's rows, in row order.
int LaunchAddGroupBias(void* y, KType type, const float* bias, int64_t width,
                       const GroupTable& table, void* stream);
int LaunchGroupBiasGrad(const void* d_y, KType type, int64_t width, const GroupTable& table,
                        float* d_bias, void* stream);
int LaunchConvert(const void* src, KType src_type, void* dst, KType dst_type, int64_t count,
                  void* stream);
int LaunchAddInPlace(float* dst, const float* src, int64_t count, void* stream);
int LaunchScale(void* data, KType type, float alpha, int64_t rows, int64_t cols, int64_t ld,
                void* stream);
// fp32 GEMMs on bf16 tensor cores (engine/cuda/bf16_split.h, CudaBackend::Gemm). A list of
// bf16 parts of an fp32 value (0 hi, 1 mid, 2 lo), in the order of the blocks they fill.
struct Bf16PartList {
  static constexpr int kMax = 6;
  int count = 0;
  int part[kMax] = {};
};
// SplitBf16Parts: the listed parts of src [rows, cols] (leading dimension ld) into dst (bf16),
// beside each other ([rows, count * cols], block s in columns [s * cols, (s + 1) * cols)) or,
// with stack_rows, under each other ([count * rows, cols]). SumBf16x3Planes: c [rows, cols]
// (ldc) = alpha * ((lo + mid) + hi) + beta * c from the [rows, 3 * cols] fp32 product of the
// planes {hi, mid, lo} (c not read when beta is 0).
int LaunchSplitBf16Parts(const float* src, int64_t rows, int64_t cols, int64_t ld,
                         const Bf16PartList& parts, bool stack_rows, void* dst, void* stream);
int LaunchSumBf16x3Planes(const float* planes, int64_t rows, int64_t cols, float alpha,
                          float beta, float* c, int64_t ldc, void* stream);
struct OptimizerParams {
  bool adamw = false;
  float lr = 0, momentum = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^step (AdamW)
  float grad_scale = 1;  // the gradient is used times this (Backend::OptimizerArgs)
};
int LaunchOptimizerStep(const OptimizerParams& p, float* param, const float* grad,
                        float* state1, float* state2, int64_t count, void* stream);

// ---- FP8 quantisation (fp8_kernels.cu) ----
enum class Fp8Kind : int { kE4M3 = 0, kE5M2 = 1 };
// engine/backend.h QuantizeArgs: for each of `batch` (<= 65535) [rows, cols] matrices of src,
// amax on the device, scale[b * scale_stride] = amax / fp8_max (1 when not a finite normal
// float), dst = the codes of src / that scale (as stored, or each matrix transposed). `scratch` holds
// QuantizeScratchBytes(batch) bytes (the amax words; zeroed here). known_amax (nullable,
// batch 1): the source's amax, already computed (QuantizeArgs::amax); no amax pass then.
// amax_out (nullable, batch 1): *amax_out = max(*amax_out, max |src|) (QuantizeArgs::amax_out;
// here by an amax pass of its own, fused into the cast in the grouped launch below).
size_t QuantizeScratchBytes(int64_t batch);
int LaunchQuantizeFp8(const void* src, KType src_type, int64_t batch, int64_t rows, int64_t cols,
                      bool transpose, Fp8Kind fp8, uint8_t* dst, float* scale,
                      int64_t scale_stride, const float* known_amax, float* amax_out,
                      void* scratch, void* stream);
// The same for one matrix [rows, cols] whose rows form `groups` groups (host list group_rows,
// summing to rows): the codes go to dst (as stored; nullptr: not written) and to
// dst_grouped_t [cols, ld_grouped], each group's rows transposed into its own run of columns
// rounded up to 16 with zero codes in the pads (engine/backend.h QuantizeArgs::dst_grouped_t;
// ld_grouped = the sum of the rounded group sizes). cols <= 65535 * 32. `scratch` holds
// QuantizeScratchBytes(1) bytes; known_amax as above; amax_out reduced by the cast kernels
// themselves, from the values they read anyway.
int LaunchQuantizeFp8Grouped(const void* src, KType src_type, int64_t rows, int64_t cols,
                             const int64_t* group_rows, int64_t groups, Fp8Kind fp8,
                             uint8_t* dst, uint8_t* dst_grouped_t, int64_t ld_grouped,
                             float* scale, const float* known_amax, float* amax_out,
                             void* scratch, void* stream);
// engine/backend.h Fp8HistoryArgs, one small kernel (checked by the caller).
int LaunchFp8HistoryAmax(float* history, int64_t len, int64_t steps, int margin,
                         bool most_recent, float* amax, void* stream);

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_KERNELS_CUH_
