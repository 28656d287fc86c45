// fp8_probe: which cuBLASLt FP8 GEMM settings this GPU and cuBLASLt accept (a diagnostic for
// the GPU machine). Tries A.B^T with e4m3 operands, bf16 C/D, for: the scale pointer 16-byte
// aligned or 4 bytes off, C == D or C = nullptr (beta 0), and N = 64 or 33. Prints one line per
// combination with cuBLASLt's status.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdio>

int main() {
  cublasLtHandle_t h;
  if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) return 1;
  const int M = 96, K = 128;  // cuBLASLt m (our n), k
  void *a, *b, *d, *scales, *ws;
  cudaMalloc(&a, M * K);
  cudaMalloc(&b, 64 * K);
  cudaMalloc(&d, M * 64 * 2);
  cudaMalloc(&scales, 256);
  cudaMemset(a, 0, M * K);
  cudaMemset(b, 0, 64 * K);
  cudaMemset(scales, 0, 256);
  const size_t ws_bytes = 32 << 20;
  cudaMalloc(&ws, ws_bytes);
  for (int misaligned = 0; misaligned < 2; ++misaligned) {
    for (int c_null = 0; c_null < 2; ++c_null) {
      for (int N : {64, 33}) {
        cublasLtMatmulDesc_t desc;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
        const void* sa = static_cast<char*>(scales) + (misaligned ? 4 : 0);
        const void* sb = static_cast<char*>(scales) + 64;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa));
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb));
        cublasLtMatrixLayout_t la, lb, lc;
        cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, M, K);
        cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, N, K);
        cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, M, N, M);
        cublasLtMatmulPreference_t pref;
        cublasLtMatmulPreferenceCreate(&pref);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &ws_bytes, sizeof(ws_bytes));
        cublasLtMatmulHeuristicResult_t r;
        int found = 0;
        cublasStatus_t hs =
            cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &r, &found);
        float alpha = 1, beta = 0;
        cublasStatus_t ms = CUBLAS_STATUS_NOT_SUPPORTED;
        if (hs == CUBLAS_STATUS_SUCCESS && found > 0) {
          ms = cublasLtMatmul(h, desc, &alpha, a, la, b, lb, &beta, c_null ? nullptr : d, lc, d,
                              lc, &r.algo, ws, ws_bytes, 0);
        }
        cudaError_t sync = cudaDeviceSynchronize();
        std::printf("scale_misaligned=%d c_null=%d N=%d heuristic=%d found=%d matmul=%d sync=%s\n",
                    misaligned, c_null, N, hs, found, ms, cudaGetErrorString(sync));
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(desc);
      }
    }
  }
  cublasLtDestroy(h);
  return 0;
}
