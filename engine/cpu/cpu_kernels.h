// The CPU backend's kernels as free functions (private to engine/cpu). CpuBackend
// (cpu_backend.cc) checks nothing beyond what each function checks itself and forwards here.
// Contracts are those of the matching Backend methods in engine/backend.h.
//
//   RETURN_IF_ERROR(cpu::RouterForward(args, threads));
#ifndef MOED_ENGINE_CPU_CPU_KERNELS_H_
#define MOED_ENGINE_CPU_CPU_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "engine/backend.h"

namespace moe {
namespace cpu {

// Element i of a buffer of `type` (FP32 or BF16) as float, and the store back.
inline float LoadFloat(const void* p, DType type, int64_t i) {
  return type == DType::kBFloat16 ? Bf16ToFloat(static_cast<const uint16_t*>(p)[i])
                                  : static_cast<const float*>(p)[i];
}
inline void StoreFloat(void* p, DType type, int64_t i, float v) {
  if (type == DType::kBFloat16) {
    static_cast<uint16_t*>(p)[i] = FloatToBf16(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}
absl::Status CheckFloatType(const char* op, const char* field, DType type);

// cpu_gemm.cc
absl::Status Gemm(const GemmArgs& args, int threads);

// cpu_fp8.cc (Gemm hands FP8 operands to Fp8Gemm)
absl::Status QuantizeFp8(const QuantizeArgs& args, int threads);
absl::Status Fp8HistoryAmax(const Fp8HistoryArgs& args);
absl::Status Fp8Gemm(const GemmArgs& args, int threads);

// cpu_router.cc
absl::Status RouterForward(const RouterForwardArgs& args, int threads);
absl::Status RouterBackward(const RouterBackwardArgs& args, int threads);

// cpu_rows.cc
absl::Status RoutePlan(const RoutePlanArgs& args);
absl::Status Permute(const PermuteArgs& args);
absl::Status GatherRows(const void* src, const int32_t* index, int64_t rows, int64_t width,
                        DType dtype, void* dst, int threads);
absl::Status CombineRows(const void* y, DType y_type, const int32_t* pair_row,
                         const float* weight, int64_t tokens, int64_t top_k, int64_t width,
                         void* out, DType out_type, int threads);
absl::Status CombineBackward(const void* d_out, DType d_out_type, const void* y, DType y_type,
                             const int32_t* pair_row, const float* weight, int64_t tokens,
                             int64_t top_k, int64_t width, int64_t total_rows, void* d_y,
                             float* d_weight, int threads);

// cpu_ffn.cc
absl::Status ActivationForward(const ActivationArgs& args, int threads);
absl::Status ActivationBackward(const ActivationArgs& args, int threads);
absl::Status AddGroupBias(void* y, DType dtype, const float* bias, int64_t width,
                          GroupRows group_rows, int threads);
absl::Status GroupBiasGrad(const void* d_y, DType dtype, int64_t width, GroupRows group_rows,
                           float* d_bias, int threads);
absl::Status OptimizerStep(const Backend::OptimizerArgs& args, float* param, const float* grad,
                           float* state1, float* state2, int64_t count, int threads);

}  // namespace cpu
}  // namespace moe

#endif  // MOED_ENGINE_CPU_CPU_KERNELS_H_
