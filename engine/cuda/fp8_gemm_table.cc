#include "engine/cuda/fp8_gemm_table.h"

#include <cstdint>

namespace moe {
namespace cuda {
namespace {

struct Entry {
  int64_t hidden, ffn, up, num_experts, top_k;
  // Bit i set: Fp8Gemm i runs FP8 (it was measured faster); clear: bf16.
  Fp8GemmSet fp8;
};

// One H200, bench/results/gpu_2026-12-04/bench_fp8.jsonl (gpu_bench --compute_dtypes=bf16,fp8
// --fp8_recipes=DELAYED,CURRENT, the four presets in one process; device ms fwd+bwd):
//   qwen3 (T 16384, H 2048, F 768, E 128, k 8): bf16 8.68, FP8 9.09. Its GEMMs gained 0.90 ms
//   in FP8 (GroupedGemm 6.73 -> 5.83 ms) and the quantisation their operands need cost 1.18 ms
//   (QuantizeFp8) + 0.09 ms (the activations' amax): every GEMM in bf16. The layer's bf16
//   GEMMs carry tuned cuBLASLt configurations (cublaslt_plans.cc: 8-10 % of qwen3's step),
//   its FP8 ones do not.
//   te_seed, mixtral, dsv3: FP8 faster as a whole layer (7.29 vs 8.08, 30.82 vs 47.08, 34.40
//   vs 39.20 ms): not in the table (FP8 everywhere) until `tools/gpu_checks.sh fp8_gemms`
//   measures them GEMM by GEMM.
// Replace an entry by what `tools/gpu_checks.sh fp8_gemms` prints for its shape ("table:"
// lines): there each GEMM was measured in the layer's step, in bf16 alone against all FP8.
const Entry kH200[] = {
    {2048, 768, 1536, 128, 8, 0},  // qwen3: whole-layer measurement, every GEMM bf16
};

}  // namespace

std::optional<bool> FindFp8GemmChoice(const Fp8GemmShape& s) {
  for (const Entry& e : kH200) {
    if (e.hidden == s.hidden && e.ffn == s.ffn && e.up == s.up && e.num_experts == s.num_experts &&
        e.top_k == s.top_k) {
      return Fp8GemmIn(e.fp8, s.gemm);
    }
  }
  return std::nullopt;
}

bool Fp8GemmTableApplies(int cc_major, int cc_minor, int sm_count, size_t cublaslt_version) {
  return cc_major == 9 && cc_minor == 0 && sm_count == 132 && cublaslt_version >= 130000 &&
         cublaslt_version < 140000;
}

}  // namespace cuda
}  // namespace moe
