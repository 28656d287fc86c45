// Capacity plan, permutation, row gathers and the combine on the CPU (docs/SPEC.md Forward 7-8,
// 11, Backward 1). Every output row/token is written by exactly one thread and every sum runs in a
// fixed order (slot order for the combine), so results are bit-identical run to run.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/parallel.h"

namespace moe {
namespace cpu {

absl::Status RoutePlan(const RoutePlanArgs& a) {
  const int64_t T = a.tokens, K = a.top_k, E = a.num_experts;
  if (T < 0 || K <= 0 || E <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RoutePlan: bad sizes tokens=", T, " top_k=", K, " experts=", E));
  }
  if (a.kept_counts == nullptr ||
      (T > 0 && (a.topk_expert == nullptr || a.topk_weight == nullptr || a.kept == nullptr))) {
    return absl::InvalidArgumentError("RoutePlan: null buffer");
  }
  // Pairs of each expert in (token, slot) order: a stable counting sort.
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    const int32_t e = a.topk_expert[i];
    if (e < 0 || e >= E) {
      return absl::InvalidArgumentError(absl::StrCat("RoutePlan: expert index ", e,
                                                     " out of range [0, ", E, ")"));
    }
    ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> pairs(static_cast<size_t>(T * K));
  std::vector<int64_t> cursor(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < T * K; ++i) pairs[cursor[a.topk_expert[i]]++] = i;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (a.capacity < 0 || n <= a.capacity) {
      for (int64_t p = start[e]; p < start[e + 1]; ++p) a.kept[pairs[p]] = 1;
      a.kept_counts[e] = static_cast<int32_t>(n);
      continue;
    }
    // Keep the `capacity` highest weights; the stable sort keeps earlier tokens ahead on
    // ties, so among equal weights the later token is dropped first.
    std::stable_sort(pairs.begin() + start[e], pairs.begin() + start[e + 1],
                     [&](int64_t x, int64_t y) {
                       // NaN weights rank lowest (a strict weak order even on bad input).
                       const float wx = a.topk_weight[x], wy = a.topk_weight[y];
                       return !std::isnan(wx) && (std::isnan(wy) || wx > wy);
                     });
    for (int64_t p = start[e]; p < start[e + 1]; ++p) {
      a.kept[pairs[p]] = p - start[e] < a.capacity ? 1 : 0;
    }
    a.kept_counts[e] = static_cast<int32_t>(a.capacity);
  }
  return absl::OkStatus();
}

absl::Status Permute(const PermuteArgs& a) {
  const int64_t T = a.tokens, K = a.top_k, E = a.num_experts;
  if (T < 0 || K <= 0 || E <= 0 || a.total_rows < 0 || a.expert_offsets == nullptr ||
      (T > 0 && (a.topk_expert == nullptr || a.kept == nullptr || a.pair_row == nullptr)) ||
      (a.total_rows > 0 && a.row_token == nullptr)) {
    return absl::InvalidArgumentError("Permute: bad sizes or null buffer");
  }
  if (a.expert_offsets[0] != 0 || a.expert_offsets[E] != a.total_rows) {
    return absl::InvalidArgumentError("Permute: expert_offsets must run from 0 to total_rows");
  }
  for (int64_t r = 0; r < a.total_rows; ++r) a.row_token[r] = -1;
  std::vector<int64_t> cursor(a.expert_offsets, a.expert_offsets + E);
  // (token, slot) order within an expert: stable by token, then slot.
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t i = t * K + j;
      if (!a.kept[i]) {
        a.pair_row[i] = -1;
        continue;
      }
      const int32_t e = a.topk_expert[i];
      if (e < 0 || e >= E) return absl::InvalidArgumentError("Permute: expert index out of range");
      const int64_t row = cursor[e]++;
      if (row >= a.expert_offsets[e + 1]) {
        return absl::InvalidArgumentError(
            absl::StrCat("Permute: expert ", e, " has more kept pairs than its rows"));
      }
      a.pair_row[i] = static_cast<int32_t>(row);
      a.row_token[row] = static_cast<int32_t>(t);
    }
  }
  return absl::OkStatus();
}

absl::Status GatherRows(const void* src, const int32_t* index, int64_t rows, int64_t width,
                        DType dtype, void* dst, int threads) {
  if (rows < 0 || width < 0) return absl::InvalidArgumentError("GatherRows: negative size");
  if (rows == 0 || width == 0) return absl::OkStatus();
  if (index == nullptr || dst == nullptr) return absl::InvalidArgumentError("GatherRows: null");
  const size_t row_bytes = static_cast<size_t>(width) * DTypeSize(dtype);
  ParallelFor(threads, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      char* d = static_cast<char*>(dst) + r * row_bytes;
      if (index[r] < 0) {
        std::memset(d, 0, row_bytes);
      } else {
        std::memcpy(d, static_cast<const char*>(src) + index[r] * row_bytes, row_bytes);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CombineRows(const void* y, DType y_type, const int32_t* pair_row,
                         const float* weight, int64_t tokens, int64_t top_k, int64_t width,
                         void* out, DType out_type, int threads) {
  if (absl::Status s = CheckFloatType("CombineRows", "y_type", y_type); !s.ok()) return s;
  if (absl::Status s = CheckFloatType("CombineRows", "out_type", out_type); !s.ok()) return s;
  if (tokens < 0 || top_k <= 0 || width < 0) {
    return absl::InvalidArgumentError("CombineRows: bad sizes");
  }
  if (tokens == 0 || width == 0) return absl::OkStatus();
  ParallelFor(threads, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(width);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t r = pair_row[t * top_k + j];
        if (r < 0) continue;
        const float w = weight != nullptr ? weight[t * top_k + j] : 1.0f;
        for (int64_t h = 0; h < width; ++h) acc[h] += w * LoadFloat(y, y_type, r * width + h);
      }
      for (int64_t h = 0; h < width; ++h) StoreFloat(out, out_type, t * width + h, acc[h]);
    }
  });
  return absl::OkStatus();
}

absl::Status CombineBackward(const void* d_out, DType d_out_type, const void* y, DType y_type,
                             const int32_t* pair_row, const float* weight, int64_t tokens,
                             int64_t top_k, int64_t width, int64_t total_rows, void* d_y,
                             float* d_weight, int threads) {
  if (absl::Status s = CheckFloatType("CombineBackward", "d_out_type", d_out_type); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckFloatType("CombineBackward", "y_type", y_type); !s.ok()) return s;
  if (tokens < 0 || top_k <= 0 || width < 0 || total_rows < 0) {
    return absl::InvalidArgumentError("CombineBackward: bad sizes");
  }
  // d_y has y's dtype. Rows no pair points at (padding, or none) are zero.
  if (total_rows > 0 && width > 0) {
    std::memset(d_y, 0, static_cast<size_t>(total_rows * width) * DTypeSize(y_type));
  }
  // Each kept pair owns its own d_y row, so tokens can run in parallel.
  ParallelFor(threads, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t i = t * top_k + j;
        const int32_t r = pair_row[i];
        if (r < 0) {
          d_weight[i] = 0.0f;
          continue;
        }
        const float w = weight[i];
        double dot = 0;
        for (int64_t h = 0; h < width; ++h) {
          const float g = LoadFloat(d_out, d_out_type, t * width + h);
          StoreFloat(d_y, y_type, r * width + h, w * g);
          dot += static_cast<double>(g) * LoadFloat(y, y_type, r * width + h);
        }
        d_weight[i] = static_cast<float>(dot);
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace cpu
}  // namespace moe
