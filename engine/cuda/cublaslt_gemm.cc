#include "engine/cuda/cublaslt_gemm.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cublaslt_algo_config.h"
#include "engine/cuda/cublaslt_plans.h"
#include "engine/cuda/cuda_status.h"
#include "engine/status_macros.h"

namespace moe {
namespace cuda {

struct CublasLtGemm::Plan {
  cublasLtMatmulDescOpaque_t desc;
  cublasLtMatmulAlgo_t algo;
  // algo is engine/cuda/cublaslt_plans.h's; heuristic_algo is what the heuristic chose (what
  // runs, for the same bits, should cuBLASLt refuse algo at an exact shape).
  bool tuned = false;
  cublasLtMatmulAlgo_t heuristic_algo;
};

namespace {

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat8E4M3:
      return CUDA_R_8F_E4M3;
    case DType::kFloat8E5M2:
      return CUDA_R_8F_E5M2;
    default:
      return CUDA_R_32F;
  }
}

// The element types of our A and B (FP8 operands: a_fp8 / b_fp8, else ab_type for both).
DType TypeOfA(const GemmArgs& g) { return g.is_fp8() ? g.a_fp8 : g.ab_type; }
DType TypeOfB(const GemmArgs& g) { return g.is_fp8() ? g.b_fp8 : g.ab_type; }

// FP8 GEMMs read their operands' dequantisation scales through the descriptor (cuBLASLt's A
// is our B, so its A scale is our b_scale). The plan's descriptor is shared by every call in
// the plan's bucket, so the pointers are set right before each enqueue (the Backend contract
// serialises calls; cublasLtMatmul reads the descriptor when it is called).
absl::Status SetScalePointers(const GemmArgs& g, cublasLtMatmulDescOpaque_t* desc) {
  if (!g.is_fp8()) return absl::OkStatus();
  const void* a_scale = g.b_scale;
  const void* b_scale = g.a_scale;
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  return absl::OkStatus();
}

int AlignmentBytes(const void* p, int64_t ld, size_t elem) {
  int a = 16;
  while (a > static_cast<int>(elem) &&
         ((reinterpret_cast<uintptr_t>(p) % a) != 0 || (ld * elem) % a != 0)) {
    a /= 2;
  }
  return a;
}

// Column-major layouts of cuBLASLt's A (our B), B (our A) and C for dims m, n, k.
struct Layouts {
  cublasLtMatrixLayoutOpaque_t a, b, c;
};

absl::Status InitLayouts(const GemmArgs& g, int64_t m, int64_t n, int64_t k, int64_t lda,
                         int64_t ldb, int64_t ldc, Layouts* out) {
  // cuBLASLt A = op(B)^T, [n, k]: stored [n, k] (no transpose) or [k, n] (transposed).
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutInit(&out->a, CudaType(TypeOfB(g)),
                                                    g.trans_b ? k : n, g.trans_b ? n : k, ldb));
  // cuBLASLt B = op(A)^T, [k, m]: stored [k, m] (no transpose) or [m, k] (transposed).
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutInit(&out->b, CudaType(TypeOfA(g)),
                                                    g.trans_a ? m : k, g.trans_a ? k : m, lda));
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutInit(&out->c, CudaType(g.c_type), n, m, ldc));
  return absl::OkStatus();
}

// The expert FFN's weight gradients: d_wi_e += X_e^T d_h, d_wo_e += a^T d_y (bf16 rows, fp32
// gradient). Only these take Tuning::wgrad_algo_index.
bool IsWeightGradient(const GemmArgs& g) {
  return !g.is_fp8() && g.ab_type == DType::kBFloat16 && g.c_type == DType::kFloat32 && g.trans_a &&
         !g.trans_b;
}

void LogPlan(int64_t m, int64_t n, int64_t k, int index, int found,
             const cublasLtMatmulHeuristicResult_t& r) {
  std::fprintf(stderr,
               "cublaslt wgrad plan m=%lld n=%lld k=%lld: candidate %d of %d, algo %d tile %d "
               "stages %d split-k %d, workspace %zu B, waves %.2f\n",
               static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
               index, found, AlgoConfigValue(r.algo, CUBLASLT_ALGO_CONFIG_ID),
               AlgoConfigValue(r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
               AlgoConfigValue(r.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
               AlgoConfigValue(r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), r.workspaceSize,
               r.wavesCount);
}

// The table's configuration `c` as a cuBLASLt algorithm for the problem, if cuBLASLt accepts
// it within the workspace.
bool TunedAlgo(cublasLtHandle_t handle, const GemmArgs& g, const TunedGemmConfig& c,
               cublasLtMatmulDescOpaque_t* desc, Layouts* l, size_t workspace_bytes,
               cublasLtMatmulAlgo_t* algo) {
  const cudaDataType_t ct = CudaType(g.c_type);
  if (cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, ct,
                             ct, c.algo, algo) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  if (!SetAlgoConfig(algo, c.tile, c.stages, c.swizzle, static_cast<uint16_t>(c.cluster),
                     c.custom)) {
    return false;
  }
  cublasLtMatmulHeuristicResult_t result;
  return cublasLtMatmulAlgoCheck(handle, desc, &l->a, &l->b, &l->c, &l->c, algo, &result) ==
             CUBLAS_STATUS_SUCCESS &&
         result.workspaceSize <= workspace_bytes;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CublasLtGemm>> CublasLtGemm::Create(const Tuning& tuning) {
  std::unique_ptr<CublasLtGemm> gemm(new CublasLtGemm());
  gemm->tuning_ = tuning;
  cublasLtHandle_t handle;
  CUBLASLT_RETURN_IF_ERROR(cublasLtCreate(&handle));
  gemm->handle_ = handle;
  return gemm;
}

CublasLtGemm::~CublasLtGemm() {
  if (handle_ != nullptr) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

size_t CublasLtGemm::cached_plans() const {
  absl::MutexLock lock(&mu_);
  return plans_.size();
}

absl::StatusOr<std::shared_ptr<CublasLtGemm::Plan>> CublasLtGemm::FindPlan(
    const GemmArgs& g, int64_t m, int64_t n, int64_t k, int alignment_bits, size_t workspace_bytes,
    bool allow_tuned) {
  auto plan = std::make_shared<Plan>();
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescInit(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLASLt's transa applies to our B, transb to our A.
  const cublasOperation_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(&plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                          &op_a, sizeof(op_a)));
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(&plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                          &op_b, sizeof(op_b)));
  // FP8 (our trans_b = true, trans_a = false: cuBLASLt's "TN", the one FP8 layout Hopper
  // supports) with fp32 accumulation and the default split accumulator (no fast accumulate).
  RETURN_IF_ERROR(SetScalePointers(g, &plan->desc));
  // Leading dimensions for the query: packed at the queried size (alignment is in the key).
  const int64_t lda = g.trans_a ? m : k, ldb = g.trans_b ? k : n, ldc = n;
  Layouts layouts;
  RETURN_IF_ERROR(InitLayouts(g, m, n, k, lda, ldb, ldc, &layouts));
  cublasLtMatmulPreferenceOpaque_t pref;
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceInit(&pref));
  const uint64_t ws = workspace_bytes;
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      &pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t align_a = (alignment_bits >> 0) & 0xff, align_b = (alignment_bits >> 8) & 0xff,
                 align_c = (alignment_bits >> 16) & 0xff;
  // Our B is cuBLASLt's A and vice versa.
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      &pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b, sizeof(align_b)));
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      &pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a, sizeof(align_a)));
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      &pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      &pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
  // One candidate (the heuristic's best), or for a tuned weight-gradient GEMM the list up to
  // the tuned index: a deterministic choice (see Tuning).
  constexpr int kMaxCandidates = 16;
  const int wanted = std::min(AlgoIndex(g) + 1, kMaxCandidates);
  cublasLtMatmulHeuristicResult_t results[kMaxCandidates];
  int found = 0;
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(
      static_cast<cublasLtHandle_t>(handle_), &plan->desc, &layouts.a, &layouts.b, &layouts.c,
      &layouts.c, &pref, wanted, results, &found));
  if (found == 0) {
    return absl::UnimplementedError(absl::StrCat(
        "cuBLASLt has no algorithm for GEMM m=", m, " n=", n, " k=", k,
        " a=", DTypeName(TypeOfA(g)), " b=", DTypeName(TypeOfB(g)), " c=", DTypeName(g.c_type)));
  }
  const int index = std::min(wanted, found) - 1;
  plan->algo = results[index].algo;
  if (tuning_.log_plans && IsWeightGradient(g)) LogPlan(m, n, k, index, found, results[index]);
  constexpr int kAligned16 = 16 | 16 << 8 | 16 << 16;
  if (allow_tuned && tuning_.tuned_plans && index == 0 && !g.is_fp8() &&
      g.ab_type == DType::kBFloat16 &&
      (g.c_type == DType::kBFloat16 || g.c_type == DType::kFloat32) &&
      alignment_bits == kAligned16) {
    const std::optional<TunedGemmConfig> tuned =
        FindTunedGemm({g.trans_a, g.trans_b, g.c_type == DType::kFloat32, g.beta != 0.0f, m, n, k});
    // Only in place of the same algorithm without split-k or a reduction scheme: the same
    // order of k's sum, so the same bits (engine/cuda/cublaslt_plans.h).
    const cublasLtMatmulAlgo_t& chosen = results[0].algo;
    cublasLtMatmulAlgo_t algo;
    if (tuned.has_value() && TunedMayReplace(chosen, tuned->algo) &&
        TunedAlgo(static_cast<cublasLtHandle_t>(handle_), g, *tuned, &plan->desc, &layouts,
                  workspace_bytes, &algo)) {
      plan->heuristic_algo = chosen;
      plan->algo = algo;
      plan->tuned = true;
      NoteTunedGemmPlanAdopted();
      if (tuning_.log_plans) {
        std::fprintf(stderr,
                     "cublaslt tuned plan m=%lld n=%lld k=%lld trans_a=%d trans_b=%d beta=%g: "
                     "algo %d tile %d stages %d swizzle %d cluster %d custom %d\n",
                     static_cast<long long>(m), static_cast<long long>(n),
                     static_cast<long long>(k), g.trans_a, g.trans_b, g.beta, tuned->algo,
                     tuned->tile, tuned->stages, tuned->swizzle, tuned->cluster, tuned->custom);
      }
    }
  }
  return plan;
}

int CublasLtGemm::AlgoIndex(const GemmArgs& g) const {
  if (!IsWeightGradient(g)) return 0;
  if (g.beta != 0.0f && tuning_.wgrad_accumulate_algo_index >= 0) {
    return tuning_.wgrad_accumulate_algo_index;
  }
  return tuning_.wgrad_algo_index;
}

absl::Status CublasLtGemm::Run(const GemmArgs& g, void* stream, void* workspace,
                               size_t workspace_bytes) {
  const size_t c_size = DTypeSize(g.c_type);
  const int alignment_bits = AlignmentBytes(g.a, g.lda, DTypeSize(TypeOfA(g))) |
                             (AlignmentBytes(g.b, g.ldb, DTypeSize(TypeOfB(g))) << 8) |
                             (AlignmentBytes(g.c, g.ldc, c_size) << 16);
  const int64_t bm = GemmDimBucket(g.m), bn = GemmDimBucket(g.n), bk = GemmDimBucket(g.k);
  const int operand_types = static_cast<int>(TypeOfA(g)) * 16 + static_cast<int>(TypeOfB(g));
  // GEMMs that accumulate (beta != 0) have their own plans: a tuned configuration, or a
  // weight gradient's Tuning index, may differ from the written one's.
  const int gemm_class = (IsWeightGradient(g) ? 2 : 0) + (g.beta != 0.0f ? 1 : 0);
  const Key key{g.trans_a, g.trans_b,      operand_types, static_cast<int>(g.c_type), bm, bn,
                bk,        alignment_bits, gemm_class};
  std::shared_ptr<Plan> plan;
  {
    absl::MutexLock lock(&mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) plan = it->second;
  }
  if (plan == nullptr) {
    ASSIGN_OR_RETURN(plan, FindPlan(g, bm, bn, bk, alignment_bits, workspace_bytes,
                                    /*allow_tuned=*/true));
    absl::MutexLock lock(&mu_);
    plans_.emplace(key, plan);
  }
  Layouts layouts;
  RETURN_IF_ERROR(InitLayouts(g, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, &layouts));
  RETURN_IF_ERROR(SetScalePointers(g, &plan->desc));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cublasStatus_t st = cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), &plan->desc, &g.alpha,
                                     g.b, &layouts.a, g.a, &layouts.b, &g.beta, g.c, &layouts.c,
                                     g.c, &layouts.c, &plan->algo, workspace, workspace_bytes, s);
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  if (plan->tuned) {
    // The tuned configuration does not fit this exact shape: the heuristic's choice for the
    // bucket, as with CudaBackendOptions::cublaslt_tuned false.
    NoteTunedGemmPlanRefused();
    st = cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), &plan->desc, &g.alpha, g.b,
                        &layouts.a, g.a, &layouts.b, &g.beta, g.c, &layouts.c, g.c, &layouts.c,
                        &plan->heuristic_algo, workspace, workspace_bytes, s);
    if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  }
  // The bucket's plan does not fit this exact shape: query it exactly (not cached).
  ASSIGN_OR_RETURN(std::shared_ptr<Plan> exact,
                   FindPlan(g, g.m, g.n, g.k, alignment_bits, workspace_bytes,
                            /*allow_tuned=*/false));
  CUBLASLT_RETURN_IF_ERROR(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), &exact->desc,
                                          &g.alpha, g.b, &layouts.a, g.a, &layouts.b, &g.beta, g.c,
                                          &layouts.c, g.c, &layouts.c, &exact->algo, workspace,
                                          workspace_bytes, s));
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace moe
