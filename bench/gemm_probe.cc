// gemm_probe: cuBLASLt's configurations for the expert FFN's GEMMs of a preset, timed side by
// side on the GPU (issue 15: "pick better GEMM configurations per shape"; what it finds is
// engine/cuda/cublaslt_plans.cc's table). For each GEMM kind of the layer (forward up / down,
// the two data gradients, the two weight gradients written and accumulated) every pass runs
// all E experts' GEMMs spread over --streams streams, as CudaBackend::GroupedGemm does. The
// configurations: cuBLASLt's heuristic list for the shape (up to --candidates; index 0 is
// what the engine ran before the table) and, per --enumerate (wgrad|all|custom|none), every
// (algorithm, tile, stages, cluster, swizzle) without split-k that cublasLtMatmulAlgoCheck
// accepts, or (custom) every heuristic candidate's tile and stages with each custom option,
// cluster and swizzle (at most --max_enumerated, evenly spread), each as a table entry would
// rebuild it.
// Each is screened with one timed pass; the fastest --retime are then timed (median of --reps
// passes) right after the baseline (heuristic candidate 0; with --routed_rows each bucket's),
// since the GPU's clock drifts over a long probe and only neighbours compare. One JSON line
// per finalist: both times, TFLOP/s, its configuration and candidate 0's, the ratio, and
// `bitwise`: expert 0's output (with --routed_rows one expert's of every bucket) from the same
// inputs and initial C equals the baseline's bit for bit (a replacement must keep the
// engine's results). The best bitwise finalist at or under --gain goes to stderr as a "plan"
// line (an entry for engine/cuda/cublaslt_plans.cc, for the step to confirm). Rows per
// expert: T*k/E times --rows_scale (balanced routing), or with --routed_rows each expert's
// count when T tokens pick k distinct experts at random (fixed seed), as a step's rows spread
// over several of CublasLtGemm's row buckets: then every expert runs what the engine would
// run, its bucket's heuristic choice (the baseline) or, for a configuration, that
// configuration where a table entry would put it in (the bucket within kTunedRowsReach, its
// choice the same algorithm without split-k, cuBLASLt accepting it), and the bitwise check
// covers one expert of every bucket. Operand values: a fixed random pattern.
//
//   gemm_probe --configs=dsv3 --kinds=wgrad_wi,wgrad_wo --enumerate=wgrad
//   gemm_probe --configs=qwen3 --enumerate=all --rows_scale=0.875   # another row bucket
//   gemm_probe --configs=dsv3 --enumerate=all --routed_rows         # rows as a step spreads them
//   gemm_probe --configs=dsv3 --enumerate=custom --routed_rows      # kernel variants of a tile
//   gemm_probe --configs= --copy_gb=16   # only the memory's rates (a 16 GB copy and memset)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/presets.h"
#include "engine/cuda/cublaslt_algo_config.h"
#include "engine/cuda/cublaslt_plans.h"

ABSL_FLAG(std::string, configs, "te_seed,qwen3,mixtral,dsv3", "presets, in order");
ABSL_FLAG(std::string, kinds, "up,down,dgrad_down,dgrad_up,wgrad_wo,wgrad_wi",
          "GEMM kinds; wgrad_* run with beta 0 and 1");
ABSL_FLAG(std::string, enumerate, "wgrad",
          "beyond the heuristic: wgrad, all, custom (the heuristic's candidates with every "
          "custom option, cluster and swizzle) or none");
ABSL_FLAG(int, candidates, 16, "heuristic candidates asked for");
ABSL_FLAG(int, reps, 5, "timed passes per candidate (median)");
ABSL_FLAG(int, retime, 8, "configurations timed against the baseline after the screening");
ABSL_FLAG(double, gain, 0.97, "a plan line needs at most this time ratio to the baseline");
ABSL_FLAG(double, rows_scale, 1.0, "rows per expert: T*k/E times this (other buckets)");
ABSL_FLAG(bool, routed_rows, false,
          "rows per expert as T tokens routed to k of E experts at random, not balanced "
          "(--rows_scale then does not apply)");
ABSL_FLAG(int, max_enumerated, 400, "at most this many enumerated configurations screened");
ABSL_FLAG(int, streams, 4, "streams the experts' GEMMs are spread over");
ABSL_FLAG(int, workspace_mb, 32, "workspace per stream (the engine's default)");
ABSL_FLAG(double, copy_gb, 0,
          "first time a device-to-device copy and a memset of this many GB (the memory's "
          "read + write and write-only rates)");

namespace {

using moe::cuda::AlgoConfigValue;
using moe::cuda::GemmDimBucket;
using moe::cuda::SetAlgoConfig;

#define CUDA_CHECK(x)                                                                         \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define LT_CHECK(x)                                                                \
  do {                                                                             \
    cublasStatus_t s_ = (x);                                                       \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                             \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, \
                   static_cast<int>(s_));                                          \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

using Preset = moe::BenchPreset;

// One GEMM kind in engine/backend.h's row-major convention: C[m, n] = op(A) op(B) (+ beta C),
// A stored [k, m] when trans_a else [m, k], B stored [n, k] when trans_b else [k, n]. Strides
// between experts in elements.
struct Kind {
  std::string name;
  int64_t m, n, k;
  bool trans_a, trans_b;
  cudaDataType_t c_type;
  float beta;
  int64_t a_stride, b_stride, c_stride;
  int64_t lda, ldb, ldc;
  // The dim that counts an expert's rows: k for a weight gradient (trans_a), else m.
  int64_t rows() const { return trans_a ? k : m; }
  Kind WithRows(int64_t r) const {
    Kind out = *this;
    (trans_a ? out.k : out.m) = r;
    return out;
  }
};

// Rows per expert: balanced (T*k/E times --rows_scale), or with --routed_rows the counts of T
// tokens each routed to k distinct experts drawn uniformly (seed 1).
std::vector<int64_t> ExpertRows(const Preset& p) {
  if (!absl::GetFlag(FLAGS_routed_rows)) {
    return std::vector<int64_t>(p.experts, static_cast<int64_t>(p.tokens * p.top_k / p.experts *
                                                                absl::GetFlag(FLAGS_rows_scale)));
  }
  std::vector<int64_t> rows(p.experts, 0), order(p.experts);
  std::mt19937 rng(1);
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t e = 0; e < p.experts; ++e) order[e] = e;
    for (int64_t j = 0; j < p.top_k; ++j) {  // a partial Fisher-Yates shuffle
      std::uniform_int_distribution<int64_t> pick(j, p.experts - 1);
      std::swap(order[j], order[pick(rng)]);
      ++rows[order[j]];
    }
  }
  return rows;
}

// The kinds at `r` rows per expert, experts `s` rows apart in memory (s >= every expert's rows).
std::vector<Kind> KindsOf(const Preset& p, const std::vector<std::string>& wanted, int64_t r,
                          int64_t s) {
  const int64_t H = p.hidden, F = p.ffn, up = 2 * F;
  std::vector<Kind> all = {
      {"up", r, up, H, false, false, CUDA_R_16BF, 0.f, s * H, H * up, s * up, H, up, up},
      {"down", r, H, F, false, false, CUDA_R_16BF, 0.f, s * F, F * H, s * H, F, H, H},
      {"dgrad_down", r, F, H, false, true, CUDA_R_16BF, 0.f, s * H, F * H, s * F, H, H, F},
      {"dgrad_up", r, H, up, false, true, CUDA_R_16BF, 0.f, s * up, H * up, s * H, up, up, H},
      {"wgrad_wo", F, H, r, true, false, CUDA_R_32F, 0.f, s * F, s * H, F * H, F, H, H},
      {"wgrad_wo", F, H, r, true, false, CUDA_R_32F, 1.f, s * F, s * H, F * H, F, H, H},
      {"wgrad_wi", H, up, r, true, false, CUDA_R_32F, 0.f, s * H, s * up, H * up, H, up, up},
      {"wgrad_wi", H, up, r, true, false, CUDA_R_32F, 1.f, s * H, s * up, H * up, H, up, up},
  };
  std::vector<Kind> out;
  for (const Kind& k : all) {
    if (std::find(wanted.begin(), wanted.end(), k.name) != wanted.end()) out.push_back(k);
  }
  return out;
}

size_t ElemSize(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

// cuBLASLt is column-major: it computes C^T = op(B)^T op(A)^T, its A being our B.
struct Problem {
  cublasLtMatmulDescOpaque_t desc;
  cublasLtMatrixLayoutOpaque_t a, b, c;
};

void InitProblem(const Kind& k, Problem* p) {
  LT_CHECK(cublasLtMatmulDescInit(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CHECK(
      cublasLtMatmulDescSetAttribute(&p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  LT_CHECK(
      cublasLtMatmulDescSetAttribute(&p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  LT_CHECK(cublasLtMatrixLayoutInit(&p->a, CUDA_R_16BF, k.trans_b ? k.k : k.n,
                                    k.trans_b ? k.n : k.k, k.ldb));
  LT_CHECK(cublasLtMatrixLayoutInit(&p->b, CUDA_R_16BF, k.trans_a ? k.m : k.k,
                                    k.trans_a ? k.k : k.m, k.lda));
  LT_CHECK(cublasLtMatrixLayoutInit(&p->c, k.c_type, k.n, k.m, k.ldc));
}

std::string Describe(const cublasLtMatmulAlgo_t& algo) {
  return absl::StrFormat(
      "\"algo\": %d, \"tile\": %d, \"stages\": %d, \"splitk\": %d, \"reduction\": %d, "
      "\"swizzle\": %d, \"cluster\": %d, \"inner\": %d, \"custom\": %d",
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_ID),
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
      AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION));
}

// One configuration per expert (experts of different row buckets may run different ones).
using Assignment = std::vector<cublasLtMatmulAlgo_t>;

// Device memory of one kind: every expert's A, B and C (expert e with rows[e] rows, laid out as
// kind's strides say), the streams and their workspaces.
class Bench {
 public:
  Bench(cublasLtHandle_t lt, const Kind& kind, std::vector<int64_t> rows, int streams,
        size_t workspace)
      : lt_(lt), kind_(kind), rows_(std::move(rows)), workspace_bytes_(workspace) {
    const int64_t experts = static_cast<int64_t>(rows_.size());
    InitProblem(kind, &problem_);
    problems_.resize(experts);
    for (int64_t e = 0; e < experts; ++e) InitProblem(kind.WithRows(rows_[e]), &problems_[e]);
    a_ = AllocPattern(kind.a_stride * experts * 2, 0);
    b_ = AllocPattern(kind.b_stride * experts * 2, 1 << 20);
    c_ = AllocPattern(kind.c_stride * experts * ElemSize(kind.c_type), 2 << 20);
    streams_.resize(streams);
    workspaces_.resize(streams);
    for (int i = 0; i < streams; ++i) {
      CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[i], cudaStreamNonBlocking));
      CUDA_CHECK(cudaMalloc(&workspaces_[i], workspace));
    }
    CUDA_CHECK(cudaStreamCreateWithFlags(&main_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreate(&start_));
    CUDA_CHECK(cudaEventCreate(&stop_));
    joins_.resize(streams);
    for (auto& e : joins_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~Bench() {
    for (auto& s : streams_) cudaStreamDestroy(s);
    for (auto& w : workspaces_) cudaFree(w);
    for (auto& e : joins_) cudaEventDestroy(e);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(main_);
    cudaFree(a_);
    cudaFree(b_);
    cudaFree(c_);
  }

  // The kind's problem at its own rows (where candidates are looked for).
  const Problem& problem() const { return problem_; }
  const std::vector<int64_t>& rows() const { return rows_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

  // All experts' GEMMs, expert e with algos[e], spread over the streams (experts without rows
  // skipped, as the engine does); false if cuBLASLt refused one.
  bool Pass(const Assignment& algos, float* ms) {
    CUDA_CHECK(cudaEventRecord(start_, main_));
    for (auto& s : streams_) CUDA_CHECK(cudaStreamWaitEvent(s, start_, 0));
    bool ok = true;
    size_t next = 0;
    for (size_t e = 0; e < rows_.size() && ok; ++e) {
      if (rows_[e] == 0) continue;
      const size_t i = next++ % streams_.size();
      ok = Run(algos[e], e, streams_[i], workspaces_[i]);
    }
    for (size_t i = 0; i < streams_.size(); ++i) {
      CUDA_CHECK(cudaEventRecord(joins_[i], streams_[i]));
      CUDA_CHECK(cudaStreamWaitEvent(main_, joins_[i], 0));
    }
    CUDA_CHECK(cudaEventRecord(stop_, main_));
    CUDA_CHECK(cudaEventSynchronize(stop_));
    CUDA_CHECK(cudaEventElapsedTime(ms, start_, stop_));
    return ok;
  }

  // Median of `reps` passes after one untimed one; negative if refused.
  float Time(const Assignment& algos, int reps) {
    float ms = 0;
    if (!Pass(algos, &ms)) return -1;
    std::vector<float> all;
    for (int i = 0; i < reps; ++i) {
      Pass(algos, &ms);
      all.push_back(ms);
    }
    std::sort(all.begin(), all.end());
    return all[all.size() / 2];
  }

  // Expert e's C computed with `algo` from a fixed initial C (the pattern's start).
  std::vector<char> Output(const cublasLtMatmulAlgo_t& algo, size_t e) {
    const Kind k = kind_.WithRows(rows_[e]);
    const size_t bytes = static_cast<size_t>(k.m * k.n) * ElemSize(k.c_type);
    char* c = static_cast<char*>(c_) + e * kind_.c_stride * ElemSize(kind_.c_type);
    const char* pattern = reinterpret_cast<const char*>(Pattern().data());
    for (size_t off = 0; off < bytes; off += kPatternBytes) {
      CUDA_CHECK(cudaMemcpy(c + off, pattern, std::min(kPatternBytes, bytes - off),
                            cudaMemcpyHostToDevice));
    }
    std::vector<char> out(bytes);
    if (!Run(algo, e, main_, workspaces_[0])) return {};
    CUDA_CHECK(cudaStreamSynchronize(main_));
    CUDA_CHECK(cudaMemcpy(out.data(), c, bytes, cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  static constexpr size_t kPatternBytes = 64u << 20;

  // Small random bf16 values, the same for every kind (made once: 32 M draws).
  static const std::vector<__nv_bfloat16>& Pattern() {
    static const std::vector<__nv_bfloat16>* pattern = [] {
      auto* v = new std::vector<__nv_bfloat16>(kPatternBytes / 2);
      std::mt19937 rng(1);
      std::uniform_real_distribution<float> u(-1.f, 1.f);
      for (auto& x : *v) x = __float2bfloat16(u(rng));
      return v;
    }();
    return *pattern;
  }

  bool Run(const cublasLtMatmulAlgo_t& algo, size_t e, cudaStream_t s, void* ws) {
    const float alpha = 1.f, beta = kind_.beta;
    const char* a = static_cast<const char*>(a_) + e * kind_.a_stride * 2;
    const char* b = static_cast<const char*>(b_) + e * kind_.b_stride * 2;
    char* c = static_cast<char*>(c_) + e * kind_.c_stride * ElemSize(kind_.c_type);
    Problem& p = problems_[e];
    return cublasLtMatmul(lt_, &p.desc, &alpha, b, &p.a, a, &p.b, &beta, c, &p.c, c, &p.c, &algo,
                          ws, workspace_bytes_, s) == CUBLAS_STATUS_SUCCESS;
  }

  // `bytes` of device memory filled with the pattern, starting `shift` bytes into it (so A, B
  // and C differ).
  static void* AllocPattern(size_t bytes, size_t shift) {
    const char* pattern = reinterpret_cast<const char*>(Pattern().data());
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    for (size_t off = 0; off < bytes;) {
      const size_t from = (off + shift) % kPatternBytes;
      const size_t n = std::min(kPatternBytes - from, bytes - off);
      CUDA_CHECK(
          cudaMemcpy(static_cast<char*>(p) + off, pattern + from, n, cudaMemcpyHostToDevice));
      off += n;
    }
    return p;
  }

  cublasLtHandle_t lt_;
  Kind kind_;
  std::vector<int64_t> rows_;
  size_t workspace_bytes_;
  Problem problem_;
  std::vector<Problem> problems_;
  void* a_ = nullptr;
  void* b_ = nullptr;
  void* c_ = nullptr;
  std::vector<cudaStream_t> streams_;
  std::vector<void*> workspaces_;
  std::vector<cudaEvent_t> joins_;
  cudaStream_t main_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

std::vector<cublasLtMatmulAlgo_t> Heuristic(cublasLtHandle_t lt, const Problem& p, size_t ws,
                                            int wanted) {
  cublasLtMatmulPreferenceOpaque_t pref;
  LT_CHECK(cublasLtMatmulPreferenceInit(&pref));
  const uint64_t bytes = ws;
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &bytes, sizeof(bytes)));
  const uint32_t align = 16;
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, attr, &align, sizeof(align)));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(wanted);
  int found = 0;
  Problem q = p;
  LT_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, &q.desc, &q.a, &q.b, &q.c, &q.c, &pref, wanted,
                                          results.data(), &found));
  std::vector<cublasLtMatmulAlgo_t> out;
  for (int i = 0; i < found; ++i) out.push_back(results[i].algo);
  return out;
}

std::vector<uint32_t> CapList(const cublasLtMatmulAlgo_t& algo,
                              cublasLtMatmulAlgoCapAttributes_t a) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, a, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS ||
      bytes == 0) {
    return {};
  }
  std::vector<uint32_t> v(bytes / sizeof(uint32_t));
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, a, v.data(), bytes, &bytes) !=
      CUBLAS_STATUS_SUCCESS) {
    return {};
  }
  return v;
}

// `base` with the tile, stages and custom option given and each cluster shape (auto, 1x1x1,
// 2x1x1, 1x2x1) and swizzle, without split-k (it would change the order of k's sum), appended
// to `out` where cuBLASLt's check accepts it for the problem within the workspace.
void AddClusterVariants(cublasLtHandle_t lt, const Problem& p, const cublasLtMatmulAlgo_t& base,
                        uint32_t tile, uint32_t stages, uint32_t custom, size_t ws,
                        std::vector<cublasLtMatmulAlgo_t>* out) {
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1,
                               CUBLASLT_CLUSTER_SHAPE_2x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1};
  Problem q = p;
  for (uint16_t cluster : clusters) {
    for (uint32_t swizzle = 0; swizzle < 2; ++swizzle) {
      cublasLtMatmulAlgo_t algo = base;
      if (!SetAlgoConfig(&algo, tile, stages, swizzle, cluster, custom)) continue;
      cublasLtMatmulHeuristicResult_t r;
      if (cublasLtMatmulAlgoCheck(lt, &q.desc, &q.a, &q.b, &q.c, &q.c, &algo, &r) !=
              CUBLAS_STATUS_SUCCESS ||
          r.workspaceSize > ws) {
        continue;
      }
      out->push_back(algo);
    }
  }
}

// At most `limit` of `all`, evenly spread.
std::vector<cublasLtMatmulAlgo_t> EvenlySpread(std::vector<cublasLtMatmulAlgo_t> all, int limit) {
  if (static_cast<int>(all.size()) <= limit) return all;
  std::vector<cublasLtMatmulAlgo_t> sampled;
  for (int j = 0; j < limit; ++j) sampled.push_back(all[all.size() * j / limit]);
  return sampled;
}

// --enumerate=all|wgrad: every (algorithm, tile, stages, cluster, swizzle) cuBLASLt's check
// accepts for the problem, custom option 0; at most `limit`, evenly spread.
std::vector<cublasLtMatmulAlgo_t> Enumerate(cublasLtHandle_t lt, const Problem& p,
                                            cudaDataType_t c_type, size_t ws, int limit) {
  int ids[128];
  int count = 0;
  LT_CHECK(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF,
                                    c_type, c_type, 128, ids, &count));
  std::vector<cublasLtMatmulAlgo_t> out;
  for (int i = 0; i < count; ++i) {
    cublasLtMatmulAlgo_t base;
    if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, c_type,
                               c_type, ids[i], &base) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    std::vector<uint32_t> tiles = CapList(base, CUBLASLT_ALGO_CAP_TILE_IDS);
    std::vector<uint32_t> stages = CapList(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
    if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
    if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
    for (uint32_t tile : tiles) {
      for (uint32_t stage : stages) AddClusterVariants(lt, p, base, tile, stage, 0, ws, &out);
    }
  }
  return EvenlySpread(std::move(out), limit);
}

// --enumerate=custom: each of the heuristic's candidates with every custom option cuBLASLt
// offers for it (0 to CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX), cluster shape and swizzle, its
// algorithm, tile and stages kept; at most `limit`, evenly spread. (The custom option selects
// among a tile's kernel variants; the heuristic's best candidates carried options 1, 3 and 7
// that the other modes never set.)
std::vector<cublasLtMatmulAlgo_t> EnumerateCustom(cublasLtHandle_t lt, const Problem& p,
                                                  const std::vector<cublasLtMatmulAlgo_t>& heur,
                                                  size_t ws, int limit) {
  std::vector<cublasLtMatmulAlgo_t> out;
  for (const cublasLtMatmulAlgo_t& base : heur) {
    int32_t custom_max = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max,
                                          sizeof(custom_max), &written) != CUBLAS_STATUS_SUCCESS) {
      custom_max = 0;
    }
    const uint32_t tile = AlgoConfigValue(base, CUBLASLT_ALGO_CONFIG_TILE_ID);
    const uint32_t stages = AlgoConfigValue(base, CUBLASLT_ALGO_CONFIG_STAGES_ID);
    for (int32_t custom = 0; custom <= custom_max; ++custom) {
      AddClusterVariants(lt, p, base, tile, stages, static_cast<uint32_t>(custom), ws, &out);
    }
  }
  return EvenlySpread(std::move(out), limit);
}

// `algo` as the table gives it to the engine (CublasLtGemm's TunedAlgo): rebuilt from its id,
// tile, stages, swizzle, cluster and custom option, if cuBLASLt accepts that for the problem.
// What is timed and proposed is the rebuilt form, so an entry runs what the probe measured
// (entries without the custom option, which the heuristic's candidates carry, were refused
// by the engine on 2026-12-02).
std::optional<cublasLtMatmulAlgo_t> AsTableEntry(cublasLtHandle_t lt, const Problem& p,
                                                 cudaDataType_t c_type,
                                                 const cublasLtMatmulAlgo_t& algo, size_t ws) {
  cublasLtMatmulAlgo_t out;
  if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, c_type,
                             c_type, AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_ID),
                             &out) != CUBLAS_STATUS_SUCCESS ||
      !SetAlgoConfig(
          &out, AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
          AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
          AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
          static_cast<uint16_t>(AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)),
          AlgoConfigValue(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION))) {
    return std::nullopt;
  }
  Problem q = p;
  cublasLtMatmulHeuristicResult_t check;
  if (cublasLtMatmulAlgoCheck(lt, &q.desc, &q.a, &q.b, &q.c, &q.c, &out, &check) !=
          CUBLAS_STATUS_SUCCESS ||
      check.workspaceSize > ws) {
    return std::nullopt;
  }
  return out;
}

// The engine's plans without the table (each expert's row bucket's heuristic choice) and with
// a configuration as the table's entry for the kind (CublasLtGemm::FindPlan: it replaces a
// bucket's choice of the same algorithm without split-k or a reduction scheme, if cuBLASLt
// accepts it at the bucket's shape). Without --routed_rows every expert has the kind's rows and
// simply runs the configuration.
class Plans {
 public:
  Plans(cublasLtHandle_t lt, const Kind& kind, const Bench& bench, cublasLtMatmulAlgo_t first)
      : lt_(lt), kind_(kind), bench_(bench), routed_(absl::GetFlag(FLAGS_routed_rows)) {
    for (int64_t r : bench.rows()) {
      const int64_t b = routed_ ? GemmDimBucket(r) : kind.rows();
      if (r == 0 || buckets_.count(b) != 0) continue;
      Bucket& bucket = buckets_[b];
      InitProblem(kind.WithRows(b), &bucket.problem);
      if (!routed_) {
        bucket.choice = first;
        continue;
      }
      const std::vector<cublasLtMatmulAlgo_t> h =
          Heuristic(lt, bucket.problem, bench.workspace_bytes(), 1);
      if (h.empty()) {
        std::fprintf(stderr, "no heuristic choice at %lld rows\n", static_cast<long long>(b));
        std::exit(1);
      }
      bucket.choice = h[0];
    }
  }

  size_t buckets() const { return buckets_.size(); }
  Assignment Baseline() const { return With(nullptr); }
  Assignment With(const cublasLtMatmulAlgo_t& algo) const { return With(&algo); }
  // One expert of every bucket: where a bitwise check looks.
  std::vector<size_t> Probes() const {
    std::vector<size_t> out;
    std::map<int64_t, bool> seen;
    for (size_t e = 0; e < bench_.rows().size(); ++e) {
      const int64_t r = bench_.rows()[e];
      if (r != 0 && !seen[BucketOf(r)]) seen[BucketOf(r)] = true, out.push_back(e);
    }
    return out;
  }

 private:
  struct Bucket {
    Problem problem;
    cublasLtMatmulAlgo_t choice;
  };

  int64_t BucketOf(int64_t rows) const { return routed_ ? GemmDimBucket(rows) : kind_.rows(); }

  Assignment With(const cublasLtMatmulAlgo_t* algo) const {
    Assignment out(bench_.rows().size());
    for (size_t e = 0; e < out.size(); ++e) {
      const int64_t r = bench_.rows()[e];
      if (r == 0) continue;
      const Bucket& bucket = buckets_.at(BucketOf(r));
      out[e] = bucket.choice;
      if (algo == nullptr) continue;
      if (!routed_) {
        out[e] = *algo;
        continue;
      }
      // An entry probed at the kind's rows serves the buckets within its reach.
      if (!moe::cuda::WithinTunedReach(kind_.rows(), BucketOf(r)) ||
          !moe::cuda::TunedMayReplace(bucket.choice,
                                      AlgoConfigValue(*algo, CUBLASLT_ALGO_CONFIG_ID))) {
        continue;
      }
      Problem q = bucket.problem;
      cublasLtMatmulHeuristicResult_t check;
      if (cublasLtMatmulAlgoCheck(lt_, &q.desc, &q.a, &q.b, &q.c, &q.c, algo, &check) ==
              CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= bench_.workspace_bytes()) {
        out[e] = *algo;
      }
    }
    return out;
  }

  cublasLtHandle_t lt_;
  Kind kind_;
  const Bench& bench_;
  bool routed_;
  std::map<int64_t, Bucket> buckets_;
};

bool SameAlgo(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

// Experts whose configuration differs between two assignments.
int Replaced(const Assignment& a, const Assignment& b, const std::vector<int64_t>& rows) {
  int n = 0;
  for (size_t e = 0; e < a.size(); ++e) n += rows[e] != 0 && !SameAlgo(a[e], b[e]);
  return n;
}

// The GEMM kind's configurations: the heuristic's list, then (per --enumerate) every accepted
// one, screened with one timed pass each; the fastest --retime are then timed against the
// baseline (the engine's plans without the table) in adjacent pairs (the GPU's clock drifts
// over a long probe, so only a ratio of neighbours is trusted). One JSON line per finalist; the
// best bitwise-equal one that gains at least --gain also as a "plan" line on stderr (what
// engine/cuda/cublaslt_plans.cc lists).
void ProbeKind(cublasLtHandle_t lt, const Preset& preset, const Kind& kind,
               const std::vector<int64_t>& rows) {
  Bench bench(lt, kind, rows, absl::GetFlag(FLAGS_streams),
              static_cast<size_t>(absl::GetFlag(FLAGS_workspace_mb)) << 20);
  const int reps = absl::GetFlag(FLAGS_reps);
  const bool routed = absl::GetFlag(FLAGS_routed_rows);
  int64_t total_rows = 0;
  for (int64_t r : rows) total_rows += r;
  const double flops = 2.0 * kind.m * kind.n * kind.k / kind.rows() * total_rows;
  std::vector<cublasLtMatmulAlgo_t> all =
      Heuristic(lt, bench.problem(), bench.workspace_bytes(), absl::GetFlag(FLAGS_candidates));
  if (all.empty()) {
    std::printf(
        "{\"bench\": \"gemm_probe\", \"config\": \"%s\", \"kind\": \"%s\", \"error\": "
        "\"no heuristic candidate\"}\n",
        preset.name, kind.name.c_str());
    return;
  }
  const cublasLtMatmulAlgo_t first = all[0];
  const size_t heuristic_count = all.size();
  const std::string mode = absl::GetFlag(FLAGS_enumerate);
  const bool wgrad = kind.name.rfind("wgrad", 0) == 0;
  if (mode == "all" || (mode == "wgrad" && wgrad)) {
    for (const auto& algo : Enumerate(lt, bench.problem(), kind.c_type, bench.workspace_bytes(),
                                      absl::GetFlag(FLAGS_max_enumerated))) {
      all.push_back(algo);
    }
  } else if (mode == "custom") {
    const std::vector<cublasLtMatmulAlgo_t> heuristic(all.begin(), all.end());
    for (const auto& algo : EnumerateCustom(lt, bench.problem(), heuristic,
                                            bench.workspace_bytes(),
                                            absl::GetFlag(FLAGS_max_enumerated))) {
      all.push_back(algo);
    }
  }
  // Every candidate as the table would give it (enumerated ones are already built that way);
  // those cuBLASLt refuses in that form are dropped.
  // origin[i]: where all[i] came from, index into the heuristic's list or the enumeration.
  size_t rebuilt_heuristic = 0;
  std::vector<std::pair<const char*, size_t>> origin = {{"heuristic", 0}};
  {
    std::vector<cublasLtMatmulAlgo_t> kept = {first};
    for (size_t i = 0; i < all.size(); ++i) {
      std::optional<cublasLtMatmulAlgo_t> entry =
          AsTableEntry(lt, bench.problem(), kind.c_type, all[i], bench.workspace_bytes());
      if (!entry.has_value()) continue;
      if (i < heuristic_count) ++rebuilt_heuristic;
      kept.push_back(*entry);
      origin.push_back(i < heuristic_count ? std::make_pair("heuristic rebuilt", i)
                                           : std::make_pair("enumerated", i - heuristic_count));
    }
    all = std::move(kept);  // all[0]: the heuristic's own first choice, as it came
  }
  const Plans plans(lt, kind, bench, first);
  const Assignment baseline = plans.Baseline();
  const std::vector<size_t> probes = plans.Probes();
  std::vector<std::vector<char>> reference;
  for (size_t e : probes) reference.push_back(bench.Output(baseline[e], e));
  std::vector<std::pair<float, size_t>> screened;
  for (size_t i = 1; i < all.size(); ++i) {
    const Assignment with = plans.With(all[i]);
    if (Replaced(with, baseline, rows) == 0) continue;
    const float ms = bench.Time(with, 1);
    if (ms > 0) screened.push_back({ms, i});
  }
  std::sort(screened.begin(), screened.end());
  const auto [min_rows, max_rows] = std::minmax_element(rows.begin(), rows.end());
  std::fprintf(stderr,
               "%s %s beta %g: %zu configurations (%zu of the heuristic's %zu as the table "
               "gives them), %zu ran; rows %lld to %lld in %zu buckets\n",
               preset.name, kind.name.c_str(), kind.beta, all.size() - 1, rebuilt_heuristic,
               heuristic_count, screened.size() + 1, static_cast<long long>(*min_rows),
               static_cast<long long>(*max_rows), plans.buckets());
  double best_ratio = 1.0;
  std::optional<size_t> best;
  const int finalists = std::min<int>(absl::GetFlag(FLAGS_retime), screened.size());
  for (int j = 0; j < finalists; ++j) {
    const size_t i = screened[j].second;
    const Assignment with = plans.With(all[i]);
    const float first_ms = bench.Time(baseline, reps);
    const float ms = bench.Time(with, reps);
    if (first_ms <= 0 || ms <= 0) continue;  // cuBLASLt refused one of them at an exact shape
    const double ratio = ms / first_ms;
    bool bitwise = true;
    for (size_t p = 0; p < probes.size() && bitwise; ++p) {
      const std::vector<char> out = bench.Output(with[probes[p]], probes[p]);
      bitwise = !out.empty() && out == reference[p];
    }
    if (bitwise && ratio < best_ratio) best_ratio = ratio, best = i;
    std::printf(
        "{\"bench\": \"gemm_probe\", \"config\": \"%s\", \"kind\": \"%s\", \"beta\": %g, "
        "\"m\": %lld, \"n\": %lld, \"k\": %lld, \"experts\": %lld, \"routed_rows\": %s, "
        "\"rows_min\": %lld, \"rows_max\": %lld, \"buckets\": %zu, \"replaced\": %d, "
        "\"source\": \"%s\", \"index\": %zu, %s, \"ms\": %.4f, \"tflops\": %.1f, "
        "\"first_ms\": %.4f, \"first_tflops\": %.1f, \"vs_first\": %.4f, \"first\": {%s}, "
        "\"bitwise\": %s}\n",
        preset.name, kind.name.c_str(), kind.beta, static_cast<long long>(kind.m),
        static_cast<long long>(kind.n), static_cast<long long>(kind.k),
        static_cast<long long>(preset.experts), routed ? "true" : "false",
        static_cast<long long>(*min_rows), static_cast<long long>(*max_rows), plans.buckets(),
        Replaced(with, baseline, rows), origin[i].first, origin[i].second, Describe(all[i]).c_str(),
        ms, flops / ms * 1e-9, first_ms, flops / first_ms * 1e-9, ratio, Describe(first).c_str(),
        bitwise ? "true" : "false");
    std::fflush(stdout);
  }
  if (best.has_value() && best_ratio <= absl::GetFlag(FLAGS_gain)) {
    // As an entry of engine/cuda/cublaslt_plans.cc's table, to be confirmed in the step.
    const cublasLtMatmulAlgo_t& a = all[*best];
    const char* t = "NT";
    std::fprintf(stderr,
                 "plan {{%c, %c, %s, %s, %lld, %lld, %lld}, {%d, %d, %d, %d, %d, %d}},  // %s %s "
                 "%.3f%s\n",
                 t[kind.trans_a], t[kind.trans_b], kind.c_type == CUDA_R_32F ? "true" : "false",
                 kind.beta != 0 ? "true" : "false", static_cast<long long>(kind.m),
                 static_cast<long long>(kind.n), static_cast<long long>(kind.k),
                 AlgoConfigValue(a, CUBLASLT_ALGO_CONFIG_ID),
                 AlgoConfigValue(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                 AlgoConfigValue(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                 AlgoConfigValue(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                 AlgoConfigValue(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                 AlgoConfigValue(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), preset.name,
                 kind.name.c_str(), best_ratio, routed ? " routed rows" : "");
  }
}

// A device-to-device copy of `gb` GB (read and written once), median of 5 after one: the rate
// at which memory-bound GEMMs (the weight gradients' fp32 outputs) could at best stream.
void TimeCopy(double gb) {
  const size_t bytes = static_cast<size_t>(gb * 1e9);
  void *src = nullptr, *dst = nullptr;
  CUDA_CHECK(cudaMalloc(&src, bytes));
  CUDA_CHECK(cudaMalloc(&dst, bytes));
  CUDA_CHECK(cudaMemset(src, 1, bytes));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  // The median of five timed runs of `op` (one untimed first).
  auto median_ms = [&](auto op) {
    std::vector<float> all;
    for (int i = 0; i < 6; ++i) {
      CUDA_CHECK(cudaEventRecord(start));
      op();
      CUDA_CHECK(cudaEventRecord(stop));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (i > 0) all.push_back(ms);
    }
    std::sort(all.begin(), all.end());
    return static_cast<double>(all[all.size() / 2]);
  };
  const double ms =
      median_ms([&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
  // A zeroed step's weight gradients only write their fp32 outputs: the write-only rate.
  const double write_ms = median_ms([&] { CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes)); });
  std::printf(
      "{\"bench\": \"gemm_probe\", \"copy_bytes\": %zu, \"ms\": %.4f, "
      "\"read_plus_write_tbps\": %.3f, \"memset_ms\": %.4f, \"write_tbps\": %.3f}\n",
      bytes, ms, 2.0 * bytes / ms * 1e-9, write_ms, bytes / write_ms * 1e-9);
  std::fflush(stdout);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(src);
  cudaFree(dst);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_copy_gb) > 0) TimeCopy(absl::GetFlag(FLAGS_copy_gb));
  cublasLtHandle_t lt;
  LT_CHECK(cublasLtCreate(&lt));
  const std::vector<std::string> kinds = absl::StrSplit(absl::GetFlag(FLAGS_kinds), ',');
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_configs), ',', absl::SkipEmpty())) {
    const Preset* preset = moe::FindBenchPreset(name);
    if (preset == nullptr) {
      std::fprintf(stderr, "unknown config %s\n", std::string(name).c_str());
      return 2;
    }
    const std::vector<int64_t> rows = ExpertRows(*preset);
    const int64_t mean = absl::GetFlag(FLAGS_routed_rows)
                             ? preset->tokens * preset->top_k / preset->experts
                             : rows[0];
    for (const Kind& kind :
         KindsOf(*preset, kinds, mean, *std::max_element(rows.begin(), rows.end()))) {
      ProbeKind(lt, *preset, kind, rows);
    }
  }
  cublasLtDestroy(lt);
  return 0;
}
