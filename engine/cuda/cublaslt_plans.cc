#include "engine/cuda/cublaslt_plans.h"

#include <atomic>
#include <cmath>

namespace moe {
namespace cuda {
namespace {

struct Entry {
  TunedGemmShape shape;
  TunedGemmConfig config;
};

// Found on one H200 (cuBLASLt 13.1) by bench/gemm_probe, then kept only where the layer's step
// confirmed it: gpu_bench with and without the table in one call
// (history/PERFORMANCE-2026-11-29_12-03.md "Expert GEMM configurations by measurement"; each
// entry's probe time ratio to the engine's choice beside it). qwen3's (H 2048, F 768, 128
// experts, k 8; 2026-12-01, `--enumerate=all [--rows_scale=0.875|1.25]`, JSON in git:
// `git show 7b91344:bench/results/gpu_2026-12-01/gemm_probe/probe.jsonl`) made its step
// 8-10 % faster. dsv3's and te_seed's are from `--enumerate=all --routed_rows` (2026-12-02:
// every expert's rows as random routing spreads them over the row buckets, each running what
// FindPlan would give it). Probed with equal rows for every expert instead, dsv3's entries
// had made the step slower (forward +25 %): a step's rows fall in the buckets 224..320, where
// configurations chosen at exactly 256 lost. cuBLASLt's heuristic candidates carry a custom
// option (7 for te_seed's), which entries did not set until 2026-12-02: rebuilt without it,
// cuBLASLt refused most of them (the earlier te_seed entries and dsv3's weight-gradient
// candidates were never taken in the engine: the GPU test TunedGemmPlansKeepResults found
// none), so entries now carry it (TunedGemmConfig::custom) and the probe times every
// candidate as an entry rebuilds it. Entries with a sixth field carry a custom option, found
// by `--enumerate=custom --routed_rows` (every heuristic candidate with each custom option,
// cluster and swizzle: history/PERFORMANCE-2026-11-29_12-03.md "Every custom option, and more
// entries"; all of mixtral's and most of dsv3's and te_seed's); the others have 0 (from
// `--enumerate=all`). A
// configuration of another algorithm than the heuristic's (21, for dsv3's accumulated d_wo)
// gave other bits at other row counts. Every entry is algorithm 66, the heuristic's own, with
// its stages (35, 64xAUTO). Tiles 20 128x128, 21 256x64, 23 128x256, 24 256x128, 29 128x160,
// 30 160x128, 31 192x128, 32 128x192, 108 56x320, 137 80x256, 166 112x192, 201 176x128,
// 248 320x128, 458 192x96;
// clusters 2 1x1x1, 3 2x1x1, 5 1x2x1 (the heuristic's choices here used 2 to 8 SMs: 2x1x1,
// 1x2x1, 4x1x1, 4x2x1, 2x4x1).
constexpr bool N = false, T = true;
const Entry kH200[] = {
    // up: h = X wi
    {{N, N, false, false, 896, 1536, 2048}, {66, 20, 35, 0, 2}},   // 0.870
    {{N, N, false, false, 1024, 1536, 2048}, {66, 21, 35, 1, 2}},  // 0.816
    {{N, N, false, false, 1280, 1536, 2048}, {66, 20, 35, 0, 2}},  // 0.874
    // down: y = a wo
    {{N, N, false, false, 896, 2048, 768}, {66, 201, 35, 1, 2}},  // 0.938
    {{N, N, false, false, 1024, 2048, 768}, {66, 21, 35, 1, 5}},  // 0.943
    {{N, N, false, false, 1280, 2048, 768}, {66, 20, 35, 0, 2}},  // 0.910
    // d_a = d_y wo^T
    {{N, T, false, false, 896, 768, 2048}, {66, 108, 35, 1, 2}},   // 0.757
    {{N, T, false, false, 1024, 768, 2048}, {66, 137, 35, 0, 2}},  // 0.861
    {{N, T, false, false, 1280, 768, 2048}, {66, 20, 35, 0, 2}},   // 0.941
    // d_X = d_h wi^T
    {{N, T, false, false, 896, 2048, 1536}, {66, 201, 35, 1, 2}},   // 0.878
    {{N, T, false, false, 1024, 2048, 1536}, {66, 201, 35, 1, 5}},  // 0.801
    {{N, T, false, false, 1280, 2048, 1536}, {66, 20, 35, 0, 5}},   // 0.937
    // d_wo (+)= a^T d_y, d_wi (+)= X^T d_h, written and accumulated
    {{T, N, true, false, 768, 2048, 1024}, {66, 30, 35, 0, 3}},   // 0.822
    {{T, N, true, true, 768, 2048, 1024}, {66, 30, 35, 1, 5}},    // 0.861
    {{T, N, true, false, 2048, 1536, 1024}, {66, 30, 35, 1, 5}},  // 0.950
    {{T, N, true, true, 2048, 1536, 1024}, {66, 20, 35, 0, 5}},   // 0.916
    // dsv3 (H 7168, F 2048, 256 experts, k 8), routed rows 210..301: up, down, d_a = d_y wo^T,
    // d_wo written, d_wi written and accumulated
    {{N, N, false, false, 256, 4096, 7168}, {66, 31, 35, 1, 3, 6}},   // 0.942
    {{N, N, false, false, 256, 7168, 2048}, {66, 458, 35, 0, 2, 1}},  // 0.879
    {{N, T, false, false, 256, 2048, 7168}, {66, 21, 35, 1, 2}},      // 0.618
    {{T, N, true, false, 2048, 7168, 256}, {66, 20, 35, 0, 5, 3}},    // 0.921
    {{T, N, true, false, 7168, 4096, 256}, {66, 23, 35, 0, 3, 4}},    // 0.971
    {{T, N, true, true, 7168, 4096, 256}, {66, 248, 35, 0, 5, 7}},    // 0.947
    // dsv3's deferred weight gradients (docs/SPEC.md "Weight gradients of several backwards":
    // three backwards' rows per expert in one GEMM, k around 768; `--rows_scale=3
    // --enumerate=custom`, equal rows): d_wo and d_wi, written and accumulated
    {{T, N, true, false, 2048, 7168, 768}, {66, 20, 35, 0, 5, 3}},    // 0.878
    {{T, N, true, true, 2048, 7168, 768}, {66, 24, 35, 0, 2, 7}},     // 0.885
    {{T, N, true, false, 7168, 4096, 768}, {66, 29, 35, 0, 3, 1}},    // 0.910
    {{T, N, true, true, 7168, 4096, 768}, {66, 24, 35, 0, 2, 6}},     // 0.966
    // te_seed (H 1024, F 4096, 8 experts, k 2), routed rows 8109..8322: up, down, d_a, d_X
    {{N, N, false, false, 8192, 8192, 1024}, {66, 29, 35, 0, 3, 1}},  // 0.928
    {{N, N, false, false, 8192, 1024, 4096}, {66, 32, 35, 1, 2, 7}},  // 0.966
    {{N, T, false, false, 8192, 4096, 1024}, {66, 29, 35, 0, 3, 1}},  // 0.930
    {{N, T, false, false, 8192, 1024, 8192}, {66, 24, 35, 0, 2, 5}},  // 0.956
    // mixtral (H 4096, F 14336, 8 experts, k 2), routed rows around 4096: down, d_X, d_wo written
    // and accumulated, d_wi written
    {{N, N, false, false, 4096, 4096, 14336}, {66, 24, 35, 0, 2, 4}},  // 0.957
    {{N, T, false, false, 4096, 4096, 28672}, {66, 24, 35, 0, 2, 4}},  // 0.942
    {{T, N, true, false, 14336, 4096, 4096}, {66, 29, 35, 0, 3, 1}},   // 0.936
    {{T, N, true, true, 14336, 4096, 4096}, {66, 29, 35, 0, 3, 1}},    // 0.923
    {{T, N, true, false, 4096, 28672, 4096}, {66, 248, 35, 0, 5, 7}},  // 0.968
};

int64_t Rows(const TunedGemmShape& s) { return s.trans_a ? s.k : s.m; }

// Equal in everything but the rows.
bool SameKind(const TunedGemmShape& a, const TunedGemmShape& b) {
  if (a.trans_a != b.trans_a || a.trans_b != b.trans_b || a.fp32_c != b.fp32_c ||
      a.accumulate != b.accumulate) {
    return false;
  }
  return a.trans_a ? (a.m == b.m && a.n == b.n) : (a.n == b.n && a.k == b.k);
}

std::atomic<int64_t> adopted{0}, refused{0};

}  // namespace

int64_t GemmDimBucket(int64_t v) {
  if (v <= 256) return (v + 31) / 32 * 32;
  int64_t p = 1;
  while (p * 2 <= v) p *= 2;
  const int64_t step = p / 4;
  return (v + step - 1) / step * step;
}

bool WithinTunedReach(int64_t probed_rows, int64_t rows) {
  return std::fabs(std::log(static_cast<double>(probed_rows) / static_cast<double>(rows))) <=
         std::log(kTunedRowsReach) * (1 + 1e-12);
}

std::optional<TunedGemmConfig> FindTunedGemm(const TunedGemmShape& shape) {
  const int64_t rows = Rows(shape);
  if (rows <= 0) return std::nullopt;
  const Entry* best = nullptr;
  double best_distance = 0;
  for (const Entry& e : kH200) {
    if (!SameKind(e.shape, shape) || !WithinTunedReach(Rows(e.shape), rows)) continue;
    const double distance = std::fabs(std::log(static_cast<double>(Rows(e.shape)) / rows));
    // Ties (rows exactly between two entries) go to the first listed, the smaller rows.
    if (best == nullptr || distance < best_distance) {
      best = &e;
      best_distance = distance;
    }
  }
  if (best == nullptr) return std::nullopt;
  return best->config;
}

bool TunedGemmsApply(int cc_major, int cc_minor, int sm_count, size_t cublaslt_version) {
  return cc_major == 9 && cc_minor == 0 && sm_count == 132 && cublaslt_version >= 130000 &&
         cublaslt_version < 140000;
}

int64_t TunedGemmPlansAdopted() { return adopted.load(); }
int64_t TunedGemmPlansRefused() { return refused.load(); }
void NoteTunedGemmPlanAdopted() { adopted.fetch_add(1); }
void NoteTunedGemmPlanRefused() { refused.fetch_add(1); }

}  // namespace cuda
}  // namespace moe
