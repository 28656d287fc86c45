// The four layer shapes the benchmarks name (engine_bench --config, gpu_bench and gemm_probe
// --configs): tokens per step and the expert FFN's dims, as docs/PERFORMANCE.md and issue 15's
// targets use them.
//
//   const BenchPreset* p = FindBenchPreset("qwen3");  // nullptr if unknown
//   c.hidden = p->hidden, c.ffn = p->ffn, c.num_experts = p->experts, c.top_k = p->top_k;
#ifndef MOED_BENCH_PRESETS_H_
#define MOED_BENCH_PRESETS_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace moe {

struct BenchPreset {
  const char* name;
  int64_t tokens, hidden, ffn, experts, top_k;
  bool sigmoid_grouped;  // sigmoid scores, 8 groups, top-4 groups (DeepSeek-V3)
};

inline constexpr BenchPreset kBenchPresets[] = {
    {"te_seed", 32768, 1024, 4096, 8, 2, false},  // TransformerEngine's seed test
    {"mixtral", 16384, 4096, 14336, 8, 2, false},
    {"dsv3", 8192, 7168, 2048, 256, 8, true},
    {"qwen3", 16384, 2048, 768, 128, 8, false},
};

inline const BenchPreset* FindBenchPreset(absl::string_view name) {
  for (const BenchPreset& p : kBenchPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

}  // namespace moe

#endif  // MOED_BENCH_PRESETS_H_
