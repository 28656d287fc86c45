// Row-major GEMMs (engine/backend.h GemmArgs) through cuBLASLt, with cached plans.
//
// cuBLASLt is column-major: a row-major [r, c] matrix with leading dimension ld is the
// column-major [c, r] one, so C = op(A) op(B) is computed as C^T = op(B)^T op(A)^T, i.e.
// cuBLASLt's "A" is our B and its "B" is our A. Plans (matmul descriptor + heuristic algo) are
// cached by (transposes, types, alignments, bucketed m/n/k): the token dimension of expert
// GEMMs changes every step, and a fresh heuristic query per shape would cost more than the
// GEMM. A plan found for the bucket (dims rounded up) is used for every shape in it; should
// cuBLASLt refuse it, the exact shape is queried instead.
//
//
// Weight-gradient GEMMs (bf16 operands, fp32 C, C = A^T B: the expert FFN's d_wi/d_wo, k = the
// expert's row count, C accumulated with beta = 1 after the first backward) may take another
// of cuBLASLt's heuristic candidates than the first (Tuning::wgrad_algo_index): a fixed index
// into the heuristic's list, which depends only on the shape, the library and the device, so
// every process picks the same algorithm for the same shape (bitwise reruns hold; no timing-
// based autotuning). The expert FFN's bf16 GEMMs of measured shapes take a configuration from
// engine/cuda/cublaslt_plans.h instead (Tuning::tuned_plans), likewise fixed per shape.
//
//   ASSIGN_OR_RETURN(auto gemm, CublasLtGemm::Create());
//   RETURN_IF_ERROR(gemm->Run(args, stream, workspace, workspace_bytes));
#ifndef MOED_ENGINE_CUDA_CUBLASLT_GEMM_H_
#define MOED_ENGINE_CUDA_CUBLASLT_GEMM_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/backend.h"

namespace moe {
namespace cuda {

// Deterministic plan choices (see the file comment).
struct CublasLtTuning {
  // Index into the heuristic's candidates (best first) for weight-gradient GEMMs; 0: the
  // first, as for every other GEMM. An index past the list's end takes its last entry.
  int wgrad_algo_index = 0;
  // The same for weight-gradient GEMMs that accumulate (beta != 0: C is read as well as
  // written); -1: wgrad_algo_index.
  int wgrad_accumulate_algo_index = -1;
  bool log_plans = false;  // one stderr line per weight-gradient or tuned plan
  // Take engine/cuda/cublaslt_plans.h's configuration where it lists the GEMM's shape (bf16
  // operands, 16-byte aligned, heuristic index 0): bitwise the heuristic's result, faster
  // beside GroupedGemm's other GEMMs. The backend sets it where the table was measured.
  bool tuned_plans = false;
};

class CublasLtGemm {
 public:
  using Tuning = CublasLtTuning;
  static absl::StatusOr<std::unique_ptr<CublasLtGemm>> Create(const Tuning& tuning = Tuning());
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // Enqueues C = alpha op(A) op(B) + beta C on `stream` (cudaStream_t). m, n > 0 and k > 0
  // (the backend handles empty shapes). `workspace` must stay untouched by other streams until
  // this GEMM has run.
  absl::Status Run(const GemmArgs& args, void* stream, void* workspace, size_t workspace_bytes);

  size_t cached_plans() const;

 private:
  struct Plan;
  // (trans_a, trans_b, operand types, C type, bucketed m, n, k, alignments, GEMM class).
  using Key = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, int, int>;
  CublasLtGemm() = default;
  // allow_tuned: the table's configuration may replace the heuristic's (not when a bucket's
  // plan was refused and the exact shape is queried).
  absl::StatusOr<std::shared_ptr<Plan>> FindPlan(const GemmArgs& args, int64_t m, int64_t n,
                                                 int64_t k, int alignment_bits,
                                                 size_t workspace_bytes, bool allow_tuned);
  // The heuristic candidate a GEMM takes (Tuning): 0 for all but weight gradients.
  int AlgoIndex(const GemmArgs& args) const;

  Tuning tuning_;
  void* handle_ = nullptr;  // cublasLtHandle_t
  mutable absl::Mutex mu_;
  std::map<Key, std::shared_ptr<Plan>> plans_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_CUBLASLT_GEMM_H_
