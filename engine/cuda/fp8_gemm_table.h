// The measured choice behind fp8_gemms = AUTO on CUDA (engine/fp8_gemms.h, docs/SPEC.md
// "Per-GEMM choice"): per expert GEMM at a layer shape, whether FP8 beat bf16 in the layer's
// step on one GPU kind, from `tools/gpu_checks.sh fp8_gemms` (gpu_bench with each GEMM in
// bf16 in turn against all in FP8, side by side in one process; docs/DECISIONS.md says why a
// table and not a timing at creation). A shape the table does not hold runs FP8 (the choice
// before the table); an entry says bf16 only where FP8 was not faster. Host code only, so the
// lookup is tested in CI.
//
//   if (Fp8GemmTableApplies(prop.major, prop.minor, prop.multiProcessorCount, version))
//     if (std::optional<bool> fp8 = FindFp8GemmChoice(shape)) return *fp8;
#ifndef MOED_ENGINE_CUDA_FP8_GEMM_TABLE_H_
#define MOED_ENGINE_CUDA_FP8_GEMM_TABLE_H_

#include <cstddef>
#include <optional>

#include "engine/fp8_gemms.h"

namespace moe {
namespace cuda {

// Whether FP8 was measured faster (true) or not (false) for shape.gemm at a layer of exactly
// shape's H, F, up, E and k; nullopt when the table has no entry for that shape.
std::optional<bool> FindFp8GemmChoice(const Fp8GemmShape& shape);

// Where the table applies: the GPU kind it was measured on (compute capability 9.0, 132 SMs,
// cuBLASLt 13.x: the H200, as cublaslt_plans.h's TunedGemmsApply). Elsewhere AUTO is FP8
// everywhere.
bool Fp8GemmTableApplies(int cc_major, int cc_minor, int sm_count, size_t cublaslt_version);

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_FP8_GEMM_TABLE_H_
