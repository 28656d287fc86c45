// GEMM on the CPU through OpenBLAS. fp32 operands go straight to cblas_sgemm; bf16 operands
// are widened into compact fp32 temporaries first, and a bf16 C is computed in an fp32
// temporary (loaded from C when beta != 0) and rounded once at the end.
#include <cblas.h>

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/parallel.h"

namespace moe {
namespace cpu {
namespace {

// Copies a rows x cols matrix with leading dimension ld into a compact fp32 array
// (parallel over rows; each element is an exact widening).
std::vector<float> Widen(const void* src, DType type, int64_t rows, int64_t cols, int64_t ld,
                         int threads) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  ParallelFor(threads, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)),
              [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                  float* o = out.data() + r * cols;
                  if (type == DType::kBFloat16) {
                    const uint16_t* in = static_cast<const uint16_t*>(src) + r * ld;
                    for (int64_t c = 0; c < cols; ++c) o[c] = Bf16ToFloat(in[c]);
                  } else {
                    const float* in = static_cast<const float*>(src) + r * ld;
                    std::copy(in, in + cols, o);
                  }
                }
              });
  return out;
}

}  // namespace

absl::Status CheckFloatType(const char* op, const char* field, DType type) {
  if (type != DType::kFloat32 && type != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", field, " must be FP32 or BF16, got ", DTypeName(type)));
  }
  return absl::OkStatus();
}

// OpenBLAS's sgemm rounds a row of C differently with the number of rows M it is given and
// with the row's place among them: its kernels tile the rows (OpenBLAS's N, row-major) into
// micro-tiles of several widths whose sums run in other orders (measured with Debian's OpenBLAS
// 0.3.21: on a Zen (AVX2) host, rows 6 to 15 of an M=16 product differ from the same row at
// place 0, while M=8 or M=4 give every place the same bits; other kernels tile otherwise).
// Rows whose A is not transposed are tokens (router logits, expert GEMMs, d_x), and a token's
// result must not depend on which others share its step or where it lands among them (moed
// merges callers' forwards: server/README.md, "Cross-caller batching"), so C is computed in
// blocks of RowBlock(n, k) rows, the last padded with zero rows: every row goes through one
// kernel at one M, in a place whose bits are those of any other place. That block is found
// once per shape by a probe on this host's kernels (RowBlockFor): the largest of 16, 8, 4, 2
// for which every place of a block gives a row's bits at place 0, or 1 (one row per call,
// place-free by construction). tests/engine/row_independence_test and
// tests/ep/ep_row_independence_test check the layer's rows.
constexpr int64_t kRowBlocks[] = {16, 8, 4, 2};

// Whether, at M = b, every row's bits are the same in every place of the block, whatever the
// other rows (random data; a kernel that sums a place differently shows it in nearly every
// element).
bool PlacesAgree(int64_t b, int64_t n, int64_t k, bool trans_b, const std::vector<float>& rows,
                 const std::vector<float>& w) {
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  const int64_t ldb = trans_b ? k : n;
  std::vector<float> a(static_cast<size_t>(b * k)), c(static_cast<size_t>(b * n)), ref;
  // Row 0 of `rows` at every place p, the others filled from rows 1.. (shifted by p).
  for (int64_t p = 0; p < b; ++p) {
    for (int64_t i = 0; i < b; ++i) {
      const int64_t src = i == p ? 0 : 1 + (i + p) % (b + 1);
      std::copy(rows.begin() + src * k, rows.begin() + (src + 1) * k, a.begin() + i * k);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, static_cast<blasint>(b),
                static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a.data(),
                static_cast<blasint>(k), w.data(), static_cast<blasint>(ldb), 0.0f, c.data(),
                static_cast<blasint>(n));
    if (p == 0) {
      ref.assign(c.begin(), c.begin() + n);
    } else if (!std::equal(ref.begin(), ref.end(), c.begin() + p * n)) {
      return false;
    }
  }
  return true;
}

int64_t ProbeRowBlock(int64_t n, int64_t k, bool trans_b) {
  uint32_t state = 0x9e3779b9u;
  auto next = [&state] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
  };
  std::vector<float> rows(static_cast<size_t>((kRowBlocks[0] + 2) * k));
  std::vector<float> w(static_cast<size_t>(n * k));
  for (float& v : rows) v = next();
  for (float& v : w) v = next();
  for (int64_t b : kRowBlocks) {
    if (PlacesAgree(b, n, k, trans_b, rows, w)) return b;
  }
  return 1;
}

// The row block of (n, k, trans_b) on this host, probed once per shape.
int64_t RowBlockFor(int64_t n, int64_t k, bool trans_b) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* blocks = new std::map<std::tuple<int64_t, int64_t, bool>, int64_t>();
  const auto key = std::make_tuple(n, k, trans_b);
  absl::MutexLock lock(&mu);
  auto it = blocks->find(key);
  if (it == blocks->end()) it = blocks->emplace(key, ProbeRowBlock(n, k, trans_b)).first;
  return it->second;
}

void RowBlockedSgemm(const GemmArgs& g, const float* a, int64_t lda, const float* b, int64_t ldb,
                     float* c, int64_t ldc) {
  const CBLAS_TRANSPOSE tb = g.trans_b ? CblasTrans : CblasNoTrans;
  const int64_t kRowBlock = RowBlockFor(g.n, g.k, g.trans_b);
  auto block = [&](const float* a_rows, int64_t a_ld, float* c_rows, int64_t c_ld) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, static_cast<blasint>(kRowBlock),
                static_cast<blasint>(g.n), static_cast<blasint>(g.k), g.alpha, a_rows,
                static_cast<blasint>(a_ld), b, static_cast<blasint>(ldb), g.beta, c_rows,
                static_cast<blasint>(c_ld));
  };
  const int64_t full = g.m / kRowBlock * kRowBlock;
  for (int64_t r = 0; r < full; r += kRowBlock) block(a + r * lda, lda, c + r * ldc, ldc);
  const int64_t rest = g.m - full;
  if (rest == 0) return;
  std::vector<float> a_pad(static_cast<size_t>(kRowBlock * g.k), 0.0f);
  std::vector<float> c_pad(static_cast<size_t>(kRowBlock * g.n), 0.0f);
  for (int64_t i = 0; i < rest; ++i) {
    std::copy(a + (full + i) * lda, a + (full + i) * lda + g.k, a_pad.begin() + i * g.k);
    if (g.beta != 0.0f) {
      std::copy(c + (full + i) * ldc, c + (full + i) * ldc + g.n, c_pad.begin() + i * g.n);
    }
  }
  block(a_pad.data(), g.k, c_pad.data(), g.n);
  for (int64_t i = 0; i < rest; ++i) {
    std::copy(c_pad.begin() + i * g.n, c_pad.begin() + (i + 1) * g.n, c + (full + i) * ldc);
  }
}

absl::Status Gemm(const GemmArgs& g, int threads) {
  if (g.is_fp8() || g.b_fp8 != DType::kFloat32) return Fp8Gemm(g, threads);
  if (g.m < 0 || g.n < 0 || g.k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: negative size m=", g.m, " n=", g.n, " k=", g.k));
  }
  if (absl::Status s = CheckFloatType("Gemm", "ab_type", g.ab_type); !s.ok()) return s;
  if (absl::Status s = CheckFloatType("Gemm", "c_type", g.c_type); !s.ok()) return s;
  // OpenBLAS takes 32-bit sizes here (blasint): a larger one would be silently truncated.
  const int64_t kMaxBlas = std::numeric_limits<blasint>::max();
  if (g.m > kMaxBlas || g.n > kMaxBlas || g.k > kMaxBlas || g.lda > kMaxBlas ||
      g.ldb > kMaxBlas || g.ldc > kMaxBlas) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: sizes (m=", g.m, " n=", g.n, " k=", g.k,
                                                   " lda=", g.lda, " ldb=", g.ldb, " ldc=", g.ldc,
                                                   ") exceed the BLAS limit ", kMaxBlas));
  }
  if (g.m == 0 || g.n == 0) return absl::OkStatus();
  // Storage shapes of A and B (row-major) and their minimum leading dimensions.
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  if (g.ldc < g.n || g.c == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: bad C (ldc=", g.ldc, " n=", g.n, ")"));
  }
  if (g.a_bf16 != nullptr && (g.ab_type != DType::kFloat32 || g.c_type != DType::kFloat32)) {
    return absl::InvalidArgumentError("Gemm: a_bf16 is for fp32 operands and an fp32 C only");
  }
  // A given only as bf16 (GemmArgs::a_bf16; Backend::GemmReadsBf16A) is widened below.
  const bool a_given = g.a != nullptr || g.a_bf16 != nullptr;
  if (g.k > 0 && (g.lda < a_cols || g.ldb < b_cols || !a_given || g.b == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: bad A/B (lda=", g.lda, " needs ",
                                                   a_cols, ", ldb=", g.ldb, " needs ", b_cols,
                                                   ")"));
  }
  const bool c_f32 = g.c_type == DType::kFloat32;
  std::vector<float> c_tmp;
  float* c = nullptr;
  int64_t ldc = g.ldc;
  if (c_f32) {
    c = static_cast<float*>(g.c);
  } else {
    c_tmp.assign(static_cast<size_t>(g.m * g.n), 0.0f);
    if (g.beta != 0.0f) c_tmp = Widen(g.c, g.c_type, g.m, g.n, g.ldc, threads);
    c = c_tmp.data();
    ldc = g.n;
  }
  if (g.k == 0) {
    // C = beta * C (BLAS leaves C alone only when beta == 1).
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) {
        c[i * ldc + j] = g.beta == 0.0f ? 0.0f : g.beta * c[i * ldc + j];
      }
    }
  } else {
    const float* a = static_cast<const float*>(g.a);
    const float* b = static_cast<const float*>(g.b);
    int64_t lda = g.lda, ldb = g.ldb;
    std::vector<float> a_tmp, b_tmp;
    if (g.ab_type == DType::kBFloat16) {
      a_tmp = Widen(g.a, g.ab_type, a_rows, a_cols, g.lda, threads);
      b_tmp = Widen(g.b, g.ab_type, b_rows, b_cols, g.ldb, threads);
      a = a_tmp.data();
      b = b_tmp.data();
      lda = a_cols;
      ldb = b_cols;
    } else if (a == nullptr) {  // exact: the same fp32 values as a widened copy would hold
      a_tmp = Widen(g.a_bf16, DType::kBFloat16, a_rows, a_cols, g.lda, threads);
      a = a_tmp.data();
      lda = a_cols;
    }
    if (g.trans_a) {
      cblas_sgemm(CblasRowMajor, CblasTrans, g.trans_b ? CblasTrans : CblasNoTrans,
                  static_cast<blasint>(g.m), static_cast<blasint>(g.n),
                  static_cast<blasint>(g.k), g.alpha, a, static_cast<blasint>(lda), b,
                  static_cast<blasint>(ldb), g.beta, c, static_cast<blasint>(ldc));
    } else {
      RowBlockedSgemm(g, a, lda, b, ldb, c, ldc);
    }
  }
  if (!c_f32) {
    // Round the fp32 result once into the bf16 C.
    ParallelFor(threads, g.m, std::max<int64_t>(1, 16384 / g.n), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        uint16_t* out = static_cast<uint16_t*>(g.c) + i * g.ldc;
        for (int64_t j = 0; j < g.n; ++j) out[j] = FloatToBf16(c[i * g.n + j]);
      }
    });
  }
  return absl::OkStatus();
}

}  // namespace cpu
}  // namespace moe
