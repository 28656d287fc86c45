// Reading and setting a cuBLASLt algorithm's configuration attributes (tile, stages, split-k,
// swizzle, cluster, ...), shared by the engine's tuned plans (engine/cuda/cublaslt_gemm.cc)
// and bench/gemm_probe, which finds them.
//
//   if (AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_ID) == 66 &&
//       SetAlgoConfig(&algo, /*tile=*/20, /*stages=*/35, /*swizzle=*/0, /*cluster=*/2)) ...
#ifndef MOED_ENGINE_CUDA_CUBLASLT_ALGO_CONFIG_H_
#define MOED_ENGINE_CUDA_CUBLASLT_ALGO_CONFIG_H_

#include <cublasLt.h>

#include <cstdint>

namespace moe {
namespace cuda {

// The attribute's value (the cluster and inner shape ids are 16-bit, the rest 32-bit), or -1
// if cuBLASLt does not give it.
inline int AlgoConfigValue(const cublasLtMatmulAlgo_t& algo,
                           cublasLtMatmulAlgoConfigAttributes_t attr) {
  size_t written = 0;
  if (attr == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID ||
      attr == CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID) {
    uint16_t v = 0;
    return cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) ==
                   CUBLAS_STATUS_SUCCESS
               ? v
               : -1;
  }
  int32_t v = 0;
  return cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) ==
                 CUBLAS_STATUS_SUCCESS
             ? v
             : -1;
}

// True when a tuned configuration of algorithm `algo_id` may run in place of the heuristic's
// `chosen` one and give the same bits: the same algorithm, without split-k or a reduction
// scheme (each output element then sums k in the same order). CublasLtGemm::FindPlan's rule;
// bench/gemm_probe emulates it.
inline bool TunedMayReplace(const cublasLtMatmulAlgo_t& chosen, int algo_id) {
  return AlgoConfigValue(chosen, CUBLASLT_ALGO_CONFIG_ID) == algo_id &&
         AlgoConfigValue(chosen, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1 &&
         AlgoConfigValue(chosen, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) ==
             CUBLASLT_REDUCTION_SCHEME_NONE;
}

// Sets tile, stages, swizzle, cluster and custom option on `algo`, with split-k 1; false if
// cuBLASLt refuses any of them. (cuBLASLt's heuristic candidates often carry a custom option
// other than the 0 cublasLtMatmulAlgoInit starts from: 7 for te_seed's expert GEMMs.)
inline bool SetAlgoConfig(cublasLtMatmulAlgo_t* algo, uint32_t tile, uint32_t stages,
                          uint32_t swizzle, uint16_t cluster, uint32_t custom = 0) {
  const int32_t splitk = 1;
  auto set = [&](cublasLtMatmulAlgoConfigAttributes_t attr, const void* value, size_t size) {
    return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, value, size) == CUBLAS_STATUS_SUCCESS;
  };
  return set(CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile)) &&
         set(CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages)) &&
         set(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk)) &&
         set(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle)) &&
         set(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster)) &&
         set(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom));
}

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_CUBLASLT_ALGO_CONFIG_H_
