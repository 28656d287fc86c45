// FP8 on the CPU: an exact emulation of what the CUDA backend does (docs/SPEC.md "FP8").
// Quantisation rounds with engine/fp8.h (the same codes and scales as the CUDA kernels); an
// FP8 GEMM decodes its operands to fp32 (exact) and runs the fp32 GEMM with
// alpha * (a_scale * b_scale), so only the summation order differs from the tensor cores.
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/fp8.h"

namespace moe {
namespace cpu {
namespace {

// Decodes a rows x k block of codes (leading dimension ld) into a compact fp32 array.
std::vector<float> Decode(const void* src, DType fp8, int64_t rows, int64_t k, int64_t ld,
                          int threads) {
  float table[256];
  for (int c = 0; c < 256; ++c) table[c] = Fp8ToFloat(static_cast<uint8_t>(c), fp8);
  std::vector<float> out(static_cast<size_t>(rows * k));
  ParallelFor(threads, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)),
              [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                  const uint8_t* in = static_cast<const uint8_t*>(src) + r * ld;
                  for (int64_t c = 0; c < k; ++c) out[r * k + c] = table[in[c]];
                }
              });
  return out;
}

// The codes of matrix `base` (QuantizeArgs layouts) once its scale is known.
void WriteCodes(const QuantizeArgs& q, int64_t base, float scale, int threads) {
  uint8_t* dst = static_cast<uint8_t*>(q.dst);
  uint8_t* grouped = static_cast<uint8_t*>(q.dst_grouped_t);
  const int64_t ld_grouped = grouped != nullptr ? Fp8GroupedColumns(q.group_rows) : 0;
  // Column of each row in dst_grouped_t; the pads stay the zeros written first.
  std::vector<int64_t> grouped_column;
  if (grouped != nullptr) {
    std::fill(grouped, grouped + q.cols * ld_grouped, uint8_t{0});
    int64_t col_start = 0;
    for (int64_t rows : q.group_rows) {
      for (int64_t i = 0; i < rows; ++i) grouped_column.push_back(col_start + i);
      col_start += Fp8PaddedRows(rows);
    }
  }
  ParallelFor(threads, q.rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(q.cols, 1)),
              [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                  for (int64_t c = 0; c < q.cols; ++c) {
                    const float v = LoadFloat(q.src, q.src_type, base + r * q.cols + c) / scale;
                    const uint8_t code = FloatToFp8(v, q.fp8);
                    if (dst != nullptr) {
                      dst[base + (q.transpose ? c * q.rows + r : r * q.cols + c)] = code;
                    }
                    if (grouped != nullptr) grouped[c * ld_grouped + grouped_column[r]] = code;
                  }
                }
              });
}

}  // namespace

absl::Status QuantizeFp8(const QuantizeArgs& q, int threads) {
  if (absl::Status s = CheckQuantizeArgs(q); !s.ok()) return s;  // engine/backend.h
  const int64_t n = q.rows * q.cols;
  for (int64_t b = 0; b < q.batch; ++b) {
    const int64_t base = b * n;
    // amax: max is exact and order-free (NaN ignored, as fmaxf); or as the producer found it.
    float amax = 0.0f;
    if (q.amax != nullptr) {
      amax = *q.amax;
    } else {
      for (int64_t i = 0; i < n; ++i)
        amax = std::fmax(amax, std::fabs(LoadFloat(q.src, q.src_type, base + i)));
    }
    const float scale = Fp8Scale(amax, q.fp8);
    q.scale[b * q.scale_stride] = scale;
    WriteCodes(q, base, scale, threads);
    if (q.amax_out != nullptr) {  // batch 1 (CheckQuantizeArgs): this step's amax
      float out = *q.amax_out;
      for (int64_t i = 0; i < n; ++i)
        out = std::fmax(out, std::fabs(LoadFloat(q.src, q.src_type, i)));
      *q.amax_out = out;
    }
  }
  return absl::OkStatus();
}

absl::Status Fp8HistoryAmax(const Fp8HistoryArgs& h) {
  if (absl::Status s = CheckFp8HistoryArgs(h); !s.ok()) return s;  // engine/backend.h
  *h.amax = Fp8DelayedAmax(h.history, h.len, h.steps, h.margin, h.most_recent);
  h.history[h.steps % h.len] = 0.0f;
  return absl::OkStatus();
}

absl::Status Fp8Gemm(const GemmArgs& g, int threads) {
  if (!IsFp8(g.a_fp8) || !IsFp8(g.b_fp8) ||
      (g.a_fp8 == DType::kFloat8E5M2 && g.b_fp8 == DType::kFloat8E5M2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: FP8 operands must be FP8_E4M3/FP8_E5M2 (not both E5M2), got ",
                     DTypeName(g.a_fp8), " x ", DTypeName(g.b_fp8)));
  }
  if (g.trans_a || !g.trans_b) {
    return absl::InvalidArgumentError("Gemm: FP8 operands need trans_a = false, trans_b = true");
  }
  if (g.a_scale == nullptr || g.b_scale == nullptr) {
    return absl::InvalidArgumentError("Gemm: FP8 operands need a_scale and b_scale");
  }
  // As on the GPU (cuBLASLt refuses other scale pointers): the CPU tests catch a misuse too.
  if (reinterpret_cast<uintptr_t>(g.a_scale) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(g.b_scale) % 16 != 0) {
    return absl::InvalidArgumentError("Gemm: FP8 a_scale and b_scale must be 16-byte aligned");
  }
  if (g.m < 0 || g.n < 0 || g.k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: negative size m=", g.m, " n=", g.n, " k=", g.k));
  }
  if (g.k > 0 && (g.lda < g.k || g.ldb < g.k || g.a == nullptr || g.b == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: bad FP8 A/B (lda=", g.lda, " ldb=", g.ldb, " k=", g.k, ")"));
  }
  GemmArgs f = g;
  f.a_fp8 = f.b_fp8 = DType::kFloat32;
  f.a_scale = f.b_scale = nullptr;
  f.ab_type = DType::kFloat32;
  f.alpha = g.alpha * (*g.a_scale * *g.b_scale);
  std::vector<float> a, b;
  if (g.k > 0 && g.m > 0 && g.n > 0) {
    a = Decode(g.a, g.a_fp8, g.m, g.k, g.lda, threads);
    b = Decode(g.b, g.b_fp8, g.n, g.k, g.ldb, threads);
    f.a = a.data(), f.lda = g.k;
    f.b = b.data(), f.ldb = g.k;
  }
  return Gemm(f, threads);
}

}  // namespace cpu
}  // namespace moe
