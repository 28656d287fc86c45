// GEMM configurations measured faster than cuBLASLt's heuristic choice for the expert FFN's
// bf16 GEMMs, and bit-identical to it, on one GPU kind (bench/gemm_probe on the H200, then the
// layer's step with and without them: history/PERFORMANCE-2026-11-29_12-03.md "Expert GEMM
// configurations by measurement").
//
// Why a table: cuBLASLt's heuristic ranks a configuration by the GEMM alone, but the engine
// runs an expert layer's GEMMs side by side on GroupedGemm's streams, where other tiles and
// thread-block clusters can schedule better (qwen3's 128 small experts: 5-25 % per GEMM kind
// in the probe, 8-10 % of the whole step). An entry is kept only when the probe found expert
// 0's output bitwise the heuristic choice's and the step confirmed the gain; all are the
// heuristic's own algorithm without split-k, so each output element sums k in the same order
// and a tuned plan changes the speed, never a result (the GPU test TunedGemmPlansKeepResults
// checks it at other row counts; it caught a configuration of another algorithm that did not
// hold there). The choice is fixed per shape: every process picks the same configuration (no
// run-time timing), so bitwise reruns hold as before.
//
//   if (TunedGemmsApply(prop.major, prop.minor, prop.multiProcessorCount, cublasLtGetVersion()))
//     if (auto c = FindTunedGemm({/*trans_a=*/false, false, /*fp32_c=*/false, false, m, n, k}))
//       ... cublasLtMatmulAlgoInit(..., c->algo, ...), then tile, stages, swizzle, cluster,
//           custom option
#ifndef MOED_ENGINE_CUDA_CUBLASLT_PLANS_H_
#define MOED_ENGINE_CUDA_CUBLASLT_PLANS_H_

#include <cstddef>
#include <cstdint>
#include <optional>

namespace moe {
namespace cuda {

// A GEMM in engine/backend.h's row-major convention (C[m, n] = op(A) op(B)), bf16 operands,
// fp32 accumulation, dims as CublasLtGemm buckets them.
struct TunedGemmShape {
  bool trans_a = false, trans_b = false;
  bool fp32_c = false;      // C is fp32 (else bf16)
  bool accumulate = false;  // beta != 0
  int64_t m = 0, n = 0, k = 0;
};

// cuBLASLt's cublasLtMatmulAlgoConfigAttributes_t values of a tuned configuration (split-k 1,
// no reduction scheme, inner shape undefined).
struct TunedGemmConfig {
  int algo = 0;     // CUBLASLT_ALGO_CONFIG_ID
  int tile = 0;     // cublasLtMatmulTile_t
  int stages = 0;   // cublasLtMatmulStages_t
  int swizzle = 0;  // CTA swizzling, 0 or 1
  int cluster = 0;  // cublasLtClusterShape_t
  int custom = 0;   // CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION
};

// The dimension a GEMM's plan is found and cached for (CublasLtGemm), and the dims the table's
// entries are compared in: v rounded up to a multiple of 32 up to 256, then to one of 4 steps
// per octave (257 -> 320, 513 -> 640).
int64_t GemmDimBucket(int64_t v);

// The rows of a GEMM: k for a weight gradient (trans_a: C = A^T B sums over the expert's rows),
// else m. A table entry serves the shape when every other dim and flag is equal and its probed
// rows are the nearest (by ratio) among such entries, within a factor kTunedRowsReach.
constexpr double kTunedRowsReach = 1.5;
std::optional<TunedGemmConfig> FindTunedGemm(const TunedGemmShape& shape);
// Whether an entry probed at `probed_rows` can serve `rows` (both > 0): within kTunedRowsReach
// either way, the reach itself included.
bool WithinTunedReach(int64_t probed_rows, int64_t rows);

// Where the table applies: compute capability 9.0 with 132 SMs and cuBLASLt 13.x
// (cublasLtGetVersion() in [130000, 140000)); elsewhere the heuristic decides. Measured on the
// H200; the H100 SXM has the same SMs and is taken to be alike (not measured): its results
// stay the heuristic's (same algorithm, no split-k), only the gain is unmeasured there.
bool TunedGemmsApply(int cc_major, int cc_minor, int sm_count, size_t cublaslt_version);

// How many plans in this process took a tuned configuration, and how many GEMMs cuBLASLt then
// refused one for at their exact shape (each ran the heuristic's choice for that shape
// instead, found anew per call): for tests, gpu_bench's JSON and logs.
int64_t TunedGemmPlansAdopted();
int64_t TunedGemmPlansRefused();
void NoteTunedGemmPlanAdopted();
void NoteTunedGemmPlanRefused();

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_CUBLASLT_PLANS_H_
