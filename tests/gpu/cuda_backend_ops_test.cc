// Every CUDA backend operation against the CPU backend on identical inputs (GPU machine only;
// tagged manual). Index outputs must match exactly, float outputs within fp32 rounding (or one
// bf16 ulp where the result is stored as bf16).
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "engine/cuda/cublaslt_plans.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/fp8.h"
#include "engine/status_macros.h"
#include "gtest/gtest.h"
#include "tests/gpu/backend_pair.h"

namespace moe {
namespace gpu_test {
namespace {

// Skips without a GPU, unless MOED_REQUIRE_GPU is set (the GPU machine's runs set it).
#define REQUIRE_GPU(bp)                                                     \
  if (!(bp).ok()) {                                                         \
    if (std::getenv("MOED_REQUIRE_GPU") != nullptr) FAIL() << (bp).error(); \
    GTEST_SKIP() << "no GPU: " << (bp).error();                             \
  }

// For tests that make their own CUDA backends: skips without a device, as REQUIRE_GPU does.
#define REQUIRE_CUDA_DEVICE()                                           \
  if (CudaDeviceCount() == 0) {                                         \
    if (std::getenv("MOED_REQUIRE_GPU") != nullptr) FAIL() << "no GPU"; \
    GTEST_SKIP() << "no GPU";                                           \
  }

// Runs `fn(backend, on_gpu)` on both backends and checks both statuses.
template <typename Fn>
void Both(BackendPair& bp, const Fn& fn) {
  absl::Status c = fn(bp.cpu(), false);
  ASSERT_TRUE(c.ok()) << "cpu: " << c;
  absl::Status g = fn(bp.gpu(), true);
  ASSERT_TRUE(g.ok()) << "gpu: " << g;
}
template <typename T = void>
T* P(const Mirrored& m, bool gpu) {
  return static_cast<T*>(gpu ? m.gpu.data() : m.cpu.data());
}

// A device copy of `host` on `backend` (for tests that make their own backends).
template <typename T>
absl::StatusOr<Buffer> UploadTo(Backend* backend, const std::vector<T>& host) {
  ASSIGN_OR_RETURN(Buffer b, backend->Allocate(host.size() * sizeof(T)));
  RETURN_IF_ERROR(backend->CopyFromHost(b.data(), host.data(), host.size() * sizeof(T)));
  return b;
}

struct GemmCase {
  bool ta, tb;
  int64_t m, n, k;
  DType ab, c;
  float beta;
};

TEST(CudaOps, GemmMatchesCpu) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const GemmCase cases[] = {
      {false, false, 37, 53, 29, DType::kFloat32, DType::kFloat32, 0.f},
      {true, false, 64, 48, 100, DType::kFloat32, DType::kFloat32, 1.f},
      {false, true, 130, 70, 64, DType::kFloat32, DType::kFloat32, 0.5f},
      {true, true, 16, 24, 8, DType::kFloat32, DType::kFloat32, 0.f},
      {false, false, 256, 512, 128, DType::kBFloat16, DType::kBFloat16, 0.f},
      {false, true, 200, 96, 256, DType::kBFloat16, DType::kBFloat16, 0.f},
      {true, false, 128, 256, 300, DType::kBFloat16, DType::kFloat32, 1.f},
      {false, false, 8, 8, 0, DType::kFloat32, DType::kFloat32, 0.5f},
  };
  uint64_t seed = 1;
  for (const GemmCase& gc : cases) {
    const int64_t ar = gc.ta ? gc.k : gc.m, ac = gc.ta ? gc.m : gc.k;
    const int64_t br = gc.tb ? gc.n : gc.k, bc = gc.tb ? gc.k : gc.n;
    const int64_t lda = ac + 3 * (gc.ab == DType::kFloat32), ldb = bc, ldc = gc.n;
    std::vector<float> a = RandomFloats(ar * lda, seed++), b = RandomFloats(br * ldb, seed++);
    std::vector<float> c0 = RandomFloats(gc.m * ldc, seed++);
    const bool bf = gc.ab == DType::kBFloat16;
    Mirrored A = bf ? bp.Upload(FloatsToBf16(a)) : bp.Upload(a);
    Mirrored B = bf ? bp.Upload(FloatsToBf16(b)) : bp.Upload(b);
    Mirrored C = gc.c == DType::kBFloat16 ? bp.Upload(FloatsToBf16(c0)) : bp.Upload(c0);
    Both(bp, [&](Backend* be, bool g) {
      GemmArgs args;
      args.trans_a = gc.ta, args.trans_b = gc.tb, args.m = gc.m, args.n = gc.n, args.k = gc.k;
      args.a = P(A, g), args.lda = lda, args.b = P(B, g), args.ldb = ldb;
      args.c = P(C, g), args.ldc = ldc, args.ab_type = gc.ab, args.c_type = gc.c;
      args.beta = gc.beta;
      return be->Gemm(args);
    });
    Results<float> r = gc.c == DType::kBFloat16 ? bp.DownloadBf16(C, gc.m * ldc)
                                                : bp.Download<float>(C, gc.m * ldc);
    const double tol = gc.c == DType::kBFloat16 ? 1e-2 : (bf ? 1e-4 : 1e-5);
    EXPECT_LE(MaxRelError(r), tol)
        << "m=" << gc.m << " n=" << gc.n << " k=" << gc.k << " ta=" << gc.ta << " tb=" << gc.tb;
  }
}

// An fp32 GEMM of the tensor-core tests below: C = alpha op(A) op(B) + beta C, and whether the
// short-k path is expected to take it.
struct Fp32GemmCase {
  bool ta, tb;
  int64_t m, n, k;
  float alpha, beta;
  bool tensor_cores = true;
};

// C = alpha op(A) op(B) + beta C in double, row-major, lda/ldb the stored widths.
std::vector<double> Fp64Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                             const std::vector<float>& a, const std::vector<float>& b,
                             const std::vector<float>& c0, float alpha, float beta) {
  const int64_t lda = ta ? m : k, ldb = tb ? k : n;
  std::vector<double> out(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t l = 0; l < k; ++l) {
        acc += static_cast<double>(a[ta ? l * lda + i : i * lda + l]) *
               b[tb ? j * ldb + l : l * ldb + j];
      }
      out[i * n + j] = alpha * acc + beta * static_cast<double>(c0[i * n + j]);
    }
  }
  return out;
}

// max |got - want| / max |want|.
double ErrorVsFp64(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, ref = 1e-30;
  for (size_t i = 0; i < got.size(); ++i) {
    diff = std::max(diff, std::fabs(got[i] - want[i]));
    ref = std::max(ref, std::fabs(want[i]));
  }
  return diff / ref;
}

// An fp32 GEMM whose A is given as bf16 too (GemmArgs::a_bf16: the router's logits and d_gate
// when x came as BF16) runs on bf16 tensor cores (CudaBackend::SplitFp32Gemm): within the
// SPEC's fp32 tolerance (1e-5) of an fp64 reference, bitwise repeatable, refused for non-fp32
// operands, and CudaBackendOptions::fp32_gemm_bf16x3 false gives back the fp32 GEMM bit for bit.
// Every product is exact; what remains is the tensor cores' fp32 accumulation, which on the H200
// measured 2.5-8x the fp32 FMA GEMM's error (0.5-1.8e-6 against 2.1-5.3e-7 of the largest output
// for k = 300..32768, 2026-12-01), hence the bound is the tolerance, not the fp32 GEMM's error.
TEST(CudaOps, Fp32GemmWithBf16AIsWithinFp32Tolerance) {
  REQUIRE_CUDA_DEVICE();
  const Fp32GemmCase cases[] = {
      {false, false, 1000, 64, 512, 1.f, 0.f},   // logits: x [T, H] . gate [H, E]
      {true, false, 512, 64, 1000, 1.f, 0.f},    // d_gate: x^T . d_z [T, E]
      {false, false, 333, 256, 1024, 1.f, 1.f},  // accumulating, E = 256
      {false, true, 200, 40, 300, 2.f, 0.5f},    // B stored transposed
      {true, true, 96, 8, 4096, 1.f, 0.f},       // E = 8, long k
      {true, false, 256, 8, 32768, 1.f, 0.f},    // te_seed's d_gate: k = T = 32768
  };
  CudaBackendOptions fp32_gemm;
  fp32_gemm.fp32_gemm_bf16x3 = false;
  absl::StatusOr<std::unique_ptr<Backend>> split = MakeCudaBackend(0),
                                           plain = MakeCudaBackend(0, fp32_gemm);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_TRUE(plain.ok()) << plain.status();
  uint64_t seed = 40;
  for (const Fp32GemmCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k
                                      << " ta=" << c.ta << " tb=" << c.tb);
    const int64_t ar = c.ta ? c.k : c.m, ac = c.ta ? c.m : c.k;
    const int64_t br = c.tb ? c.n : c.k, bc = c.tb ? c.k : c.n;
    // A: bf16 values (as x is), B: full fp32 values spanning several binades (as gate, d_z).
    const std::vector<uint16_t> a16 = FloatsToBf16(RandomFloats(ar * ac, seed++));
    const std::vector<float> a32 = Bf16ToFloats(a16);
    std::vector<float> b = RandomFloats(br * bc, seed++, 0.02f);
    for (size_t i = 0; i < b.size(); i += 7) b[i] *= 300.f;
    const std::vector<float> c0 = RandomFloats(c.m * c.n, seed++);
    const std::vector<double> want =
        Fp64Gemm(c.ta, c.tb, c.m, c.n, c.k, a32, b, c0, c.alpha, c.beta);
    // One GEMM on `be`; with_bf16: a_bf16 set. The result's floats.
    auto run = [&](Backend* be, bool with_bf16,
                   bool without_a = false) -> absl::StatusOr<std::vector<float>> {
      ASSIGN_OR_RETURN(Buffer da32, UploadTo(be, a32));
      ASSIGN_OR_RETURN(Buffer da16, UploadTo(be, a16));
      ASSIGN_OR_RETURN(Buffer db, UploadTo(be, b));
      ASSIGN_OR_RETURN(Buffer dc, UploadTo(be, c0));
      GemmArgs g;
      g.trans_a = c.ta, g.trans_b = c.tb, g.m = c.m, g.n = c.n, g.k = c.k;
      g.a = da32.data(), g.lda = ac, g.b = db.data(), g.ldb = bc, g.c = dc.data(), g.ldc = c.n;
      g.a_bf16 = with_bf16 ? da16.data() : nullptr;
      if (without_a) g.a = nullptr;  // GemmReadsBf16A: the fp32 A is not needed
      g.alpha = c.alpha, g.beta = c.beta;
      RETURN_IF_ERROR(be->Gemm(g));
      std::vector<float> out(c0.size());
      RETURN_IF_ERROR(be->CopyToHost(out.data(), dc.data(), out.size() * 4));
      return out;
    };
    absl::StatusOr<std::vector<float>> fast = run(split->get(), true);
    absl::StatusOr<std::vector<float>> again = run(split->get(), true);
    absl::StatusOr<std::vector<float>> fp32 = run(split->get(), false);
    absl::StatusOr<std::vector<float>> knob_off = run(plain->get(), true);
    ASSERT_TRUE(fast.ok()) << fast.status();
    ASSERT_TRUE(again.ok() && fp32.ok() && knob_off.ok());
    const double fast_err = ErrorVsFp64(*fast, want), fp32_err = ErrorVsFp64(*fp32, want);
    std::printf("m=%lld n=%lld k=%lld: bf16x3 error %.3g, fp32 GEMM error %.3g\n",
                static_cast<long long>(c.m), static_cast<long long>(c.n),
                static_cast<long long>(c.k), fast_err, fp32_err);
    EXPECT_LE(fast_err, 1e-5);
    EXPECT_TRUE(*fast == *again) << "two runs differ";
    EXPECT_TRUE(*knob_off == *fp32) << "fp32_gemm_bf16x3 = false is not the fp32 GEMM";
    ASSERT_TRUE((*split)->GemmReadsBf16A());
    ASSERT_FALSE((*plain)->GemmReadsBf16A());
    absl::StatusOr<std::vector<float>> no_a = run(split->get(), true, /*without_a=*/true);
    ASSERT_TRUE(no_a.ok()) << no_a.status();
    EXPECT_TRUE(*no_a == *fast) << "a null A changed the result";
    EXPECT_TRUE(absl::IsInvalidArgument(run(plain->get(), true, true).status()))
        << "a backend that does not read a_bf16 must refuse a null A";
  }
  {
    // n above SplitFp32Gemm's bound with no fp32 A: A widened in scratch, then the fp32 GEMM,
    // bitwise what the fp32 GEMM gives from the widened values.
    const int64_t m = 3, n = 4100, k = 5;
    const std::vector<uint16_t> a16 = FloatsToBf16(RandomFloats(m * k, 90));
    const std::vector<float> a32 = Bf16ToFloats(a16), b = RandomFloats(k * n, 91);
    auto wide = [&](bool without_a) -> absl::StatusOr<std::vector<float>> {
      Backend* be = split->get();
      ASSIGN_OR_RETURN(Buffer da32, UploadTo(be, a32));
      ASSIGN_OR_RETURN(Buffer da16, UploadTo(be, a16));
      ASSIGN_OR_RETURN(Buffer db, UploadTo(be, b));
      ASSIGN_OR_RETURN(Buffer dc, be->Allocate(m * n * 4));
      GemmArgs g;
      g.m = m, g.n = n, g.k = k, g.lda = k, g.ldb = n, g.ldc = n;
      g.a = without_a ? nullptr : da32.data(), g.b = db.data(), g.c = dc.data();
      g.a_bf16 = without_a ? da16.data() : nullptr;
      RETURN_IF_ERROR(be->Gemm(g));
      std::vector<float> out(m * n);
      RETURN_IF_ERROR(be->CopyToHost(out.data(), dc.data(), out.size() * 4));
      return out;
    };
    absl::StatusOr<std::vector<float>> widened = wide(true), fp32 = wide(false);
    ASSERT_TRUE(widened.ok()) << widened.status();
    ASSERT_TRUE(fp32.ok()) << fp32.status();
    EXPECT_TRUE(*widened == *fp32);
  }
  // a_bf16 belongs to fp32 GEMMs only.
  GemmArgs g;
  g.m = g.n = g.k = 8, g.lda = g.ldb = g.ldc = 8;
  int dummy[64];
  g.a = g.b = g.a_bf16 = dummy, g.c = dummy;
  g.ab_type = DType::kBFloat16;
  EXPECT_TRUE(absl::IsInvalidArgument((*split)->Gemm(g)));
  // ... and to Gemm: GroupedGemm's GEMMs read a.
  g.ab_type = DType::kFloat32;
  EXPECT_TRUE(absl::IsInvalidArgument((*split)->GroupedGemm({g, g})));
}

// An fp32 GEMM of two fp32 operands with a short k (the router's d_x += d_z . gate^T, k = E)
// runs on bf16 tensor cores from k = 128 (CudaBackend::ShortKFp32Gemm: six part products along
// k): within the SPEC's fp32 tolerance of an fp64 reference in every layout, bitwise
// repeatable, and not the fp32 GEMM's bits (the path ran); below k = 128, and with
// CudaBackendOptions::fp32_gemm_bf16x3 false, the fp32 GEMM runs (its bits).
TEST(CudaOps, ShortKFp32GemmIsWithinFp32Tolerance) {
  REQUIRE_CUDA_DEVICE();
  const Fp32GemmCase cases[] = {
      {false, true, 3000, 1024, 128, 1.f, 1.f, true},  // d_x [T, H] += d_z [T, E] . gate^T
      {false, false, 1000, 1024, 8, 1.f, 0.f, false},  // E = 8: the fp32 GEMM
      {false, true, 2000, 512, 64, 1.f, 1.f, false},   // E = 64: the fp32 GEMM
      {true, false, 1500, 1200, 128, 0.5f, 0.25f, true},
      {true, true, 4096, 1024, 256, 1.f, 0.f, true},
  };
  CudaBackendOptions fp32_gemm;
  fp32_gemm.fp32_gemm_bf16x3 = false;
  absl::StatusOr<std::unique_ptr<Backend>> plain = MakeCudaBackend(0, fp32_gemm);
  absl::StatusOr<std::unique_ptr<Backend>> split = MakeCudaBackend(0);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_TRUE(plain.ok()) << plain.status();
  uint64_t seed = 70;
  for (const Fp32GemmCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k
                                      << " ta=" << c.ta << " tb=" << c.tb);
    // Both operands full fp32 values over several binades (d_z and the gate).
    std::vector<float> a = RandomFloats(c.m * c.k, seed++, 0.01f),
                       b = RandomFloats(c.k * c.n, seed++);
    for (size_t i = 0; i < a.size(); i += 5) a[i] *= 1000.f;
    const std::vector<float> c0 = RandomFloats(c.m * c.n, seed++);
    const std::vector<double> want = Fp64Gemm(c.ta, c.tb, c.m, c.n, c.k, a, b, c0, c.alpha, c.beta);
    auto run = [&](Backend* be) -> absl::StatusOr<std::vector<float>> {
      ASSIGN_OR_RETURN(Buffer da, UploadTo(be, a));
      ASSIGN_OR_RETURN(Buffer db, UploadTo(be, b));
      ASSIGN_OR_RETURN(Buffer dc, UploadTo(be, c0));
      GemmArgs g;
      g.trans_a = c.ta, g.trans_b = c.tb, g.m = c.m, g.n = c.n, g.k = c.k;
      g.a = da.data(), g.lda = c.ta ? c.m : c.k, g.b = db.data(), g.ldb = c.tb ? c.k : c.n;
      g.c = dc.data(), g.ldc = c.n, g.alpha = c.alpha, g.beta = c.beta;
      RETURN_IF_ERROR(be->Gemm(g));
      std::vector<float> out(c0.size());
      RETURN_IF_ERROR(be->CopyToHost(out.data(), dc.data(), out.size() * 4));
      return out;
    };
    absl::StatusOr<std::vector<float>> fast = run(split->get()), again = run(split->get());
    absl::StatusOr<std::vector<float>> fp32 = run(plain->get());
    ASSERT_TRUE(fast.ok()) << fast.status();
    ASSERT_TRUE(again.ok() && fp32.ok());
    const double fast_err = ErrorVsFp64(*fast, want), fp32_err = ErrorVsFp64(*fp32, want);
    std::printf("m=%lld n=%lld k=%lld: short-k bf16 error %.3g, fp32 GEMM error %.3g\n",
                static_cast<long long>(c.m), static_cast<long long>(c.n),
                static_cast<long long>(c.k), fast_err, fp32_err);
    EXPECT_LE(fast_err, 1e-5);
    EXPECT_TRUE(*fast == *again) << "two runs differ";
    if (c.tensor_cores) {
      EXPECT_FALSE(*fast == *fp32) << "the fp32 GEMM's bits: the tensor-core path did not run";
    } else {
      EXPECT_TRUE(*fast == *fp32) << "k below 128 must run the fp32 GEMM";
    }
  }
}

TEST(CudaOps, GroupedGemmMatchesCpu) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  // 40 small experts (side streams) with some empty ones.
  const int64_t H = 64, N = 96, experts = 40;
  std::vector<int64_t> rows(experts);
  for (int64_t e = 0; e < experts; ++e) rows[e] = (e * 7) % 23;
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  Mirrored X = bp.Upload(FloatsToBf16(RandomFloats(total * H, 3)));
  Mirrored W = bp.Upload(FloatsToBf16(RandomFloats(experts * H * N, 4)));
  Mirrored Y = bp.Output(total * N * 2);
  Both(bp, [&](Backend* be, bool g) {
    std::vector<GemmArgs> gemms;
    int64_t off = 0;
    for (int64_t e = 0; e < experts; ++e) {
      GemmArgs a;
      a.m = rows[e], a.n = N, a.k = H;
      a.a = P<char>(X, g) + off * H * 2, a.lda = H;
      a.b = P<char>(W, g) + e * H * N * 2, a.ldb = N;
      a.c = P<char>(Y, g) + off * N * 2, a.ldc = N;
      a.ab_type = a.c_type = DType::kBFloat16;
      gemms.push_back(a);
      off += rows[e];
    }
    return be->GroupedGemm(gemms);
  });
  EXPECT_LE(MaxRelError(bp.DownloadBf16(Y, total * N)), 1e-2);
}

// The GroupedGemm knobs (engine/cuda/cuda_backend.cc): any number of side streams, and the
// serial rule, give bitwise the same result as the default, since every GEMM keeps its plan on
// any stream; a malformed value refuses to make the backend instead of being ignored.
TEST(CudaOps, GroupedGemmStreamKnobsKeepResultsAndRefuseBadValues) {
  REQUIRE_CUDA_DEVICE();
  const int64_t H = 96, N = 160, experts = 24;
  std::vector<int64_t> rows(experts);
  for (int64_t e = 0; e < experts; ++e) rows[e] = (e * 11) % 37;
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  const std::vector<uint16_t> x = FloatsToBf16(RandomFloats(total * H, 5));
  const std::vector<uint16_t> w = FloatsToBf16(RandomFloats(experts * H * N, 6));
  // One GroupedGemm on a backend made with `streams` side streams and the serial rule above
  // `serial_gflops`; the output's bytes.
  auto run = [&](int streams, int64_t serial_gflops) -> absl::StatusOr<std::vector<uint16_t>> {
    CudaBackendOptions options;
    options.gemm_streams = streams;
    options.gemm_serial_gflops = serial_gflops;
    absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(0, options);
    if (!made.ok()) return made.status();
    Backend* gpu = made->get();
    ASSIGN_OR_RETURN(Buffer dx, UploadTo(gpu, x));
    ASSIGN_OR_RETURN(Buffer dw, UploadTo(gpu, w));
    ASSIGN_OR_RETURN(Buffer dy, gpu->Allocate(total * N * 2));
    std::vector<GemmArgs> gemms;
    int64_t off = 0;
    for (int64_t e = 0; e < experts; ++e) {
      GemmArgs a;
      a.m = rows[e], a.n = N, a.k = H;
      a.a = static_cast<char*>(dx.data()) + off * H * 2, a.lda = H;
      a.b = static_cast<char*>(dw.data()) + e * H * N * 2, a.ldb = N;
      a.c = static_cast<char*>(dy.data()) + off * N * 2, a.ldc = N;
      a.ab_type = a.c_type = DType::kBFloat16;
      gemms.push_back(a);
      off += rows[e];
    }
    RETURN_IF_ERROR(gpu->GroupedGemm(gemms));
    std::vector<uint16_t> y(total * N);
    RETURN_IF_ERROR(gpu->CopyToHost(y.data(), dy.data(), y.size() * 2));
    return y;
  };
  const CudaBackendOptions defaults;
  absl::StatusOr<std::vector<uint16_t>> base =
      run(defaults.gemm_streams, defaults.gemm_serial_gflops);
  ASSERT_TRUE(base.ok()) << base.status();
  const std::pair<int, int64_t> same[] = {
      {1, 0},  {7, 0},
      {16, 0}, {defaults.gemm_streams, 1},  // every GEMM here is far smaller: side streams
      {2, 0},
  };
  for (const auto& [streams, serial] : same) {
    absl::StatusOr<std::vector<uint16_t>> y = run(streams, serial);
    ASSERT_TRUE(y.ok()) << streams << " streams, serial " << serial << ": " << y.status();
    EXPECT_TRUE(*y == *base) << streams << " streams, serial " << serial << " changed the result";
  }
  for (int bad : {0, 17, -1}) {
    absl::StatusOr<std::vector<uint16_t>> y = run(bad, 0);
    EXPECT_TRUE(absl::IsInvalidArgument(y.status()))
        << "gemm_streams=" << bad << ": " << y.status();
  }
  for (int64_t bad : {int64_t{-1}, (int64_t{1} << 30) + 1}) {
    absl::StatusOr<std::vector<uint16_t>> y = run(defaults.gemm_streams, bad);
    EXPECT_TRUE(absl::IsInvalidArgument(y.status()))
        << "gemm_serial_gflops=" << bad << ": " << y.status();
  }
}

// The tuned configurations of engine/cuda/cublaslt_plans.h: GroupedGemms of shapes the table
// lists (qwen3's, at rows around and between its probed counts, data and weight gradients
// written and accumulated) give bitwise the heuristic's result (CudaBackendOptions::cublaslt_tuned
// false), and on a device the table was measured on they are taken. (This test refused dsv3's
// probed d_wo configuration of another algorithm: other bits at other row counts.) Uniform values
// in [-1, 1) from a hashed counter (splitmix64): the tuned-plan cases' operands, up to 587 M values
// each (mixtral's d_wi and d_X), in about a second, where RandomFloats' normal distribution takes
// ~20 ns a value. The test compares two GPU runs bitwise, so any spread of values serves.
std::vector<float> FastRandomFloats(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + i;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    v[i] = static_cast<float>(static_cast<int32_t>(z >> 32)) * (1.0f / 2147483648.0f);
  }
  return v;
}

TEST(CudaOps, TunedGemmPlansKeepResults) {
  REQUIRE_CUDA_DEVICE();
  struct Case {
    const char* name;
    bool trans_a, trans_b, fp32_c;
    float beta;
    int64_t m, n, k;            // k (trans_a) or m: the expert's rows, set per expert below
    std::vector<int64_t> rows;  // of each expert
  };
  // qwen3: experts whose rows fall in the probed buckets (1024, 896, 1280), in buckets the
  // table's reach serves (768, 640 and 1792 for the data GEMMs: 1.2-1.4x off) and, for the
  // weight gradients (probed at 1024 rows only), in buckets beyond it (640, 1792: the
  // heuristic's). dsv3 and te_seed (probed with rows spread as routing spreads them, around
  // 256 over the buckets 224..320 and around 8192 over 8192..10240): rows in those buckets,
  // within the reach (192; 6144 and 12288) and, for dsv3, beyond it (160, 448). mixtral
  // (around 4096 over 4096..5120): those buckets and 3072, within the reach.
  const std::vector<int64_t> qwen3 = {1024, 850, 1250, 700, 1100, 1600, 600};
  const std::vector<int64_t> dsv3 = {256, 213, 301, 170, 270, 400, 150};
  const std::vector<int64_t> te_seed = {8192, 8322, 6000, 11000};
  const std::vector<int64_t> mixtral = {4096, 4200, 3900, 5000, 3000};
  // dsv3's deferred weight gradients: three backwards' rows of an expert together.
  const std::vector<int64_t> dsv3_deferred = {768, 700, 850, 640, 900, 560, 1100};
  const Case cases[] = {
      {"qwen3 up", false, false, false, 0.f, 1024, 1536, 2048, qwen3},
      {"qwen3 down", false, false, false, 0.f, 1024, 2048, 768, qwen3},
      {"qwen3 d_a", false, true, false, 0.f, 1024, 768, 2048, qwen3},
      {"qwen3 d_X", false, true, false, 0.f, 1024, 2048, 1536, qwen3},
      {"qwen3 d_wo", true, false, true, 0.f, 768, 2048, 1024, qwen3},
      {"qwen3 d_wo accumulated", true, false, true, 1.f, 768, 2048, 1024, qwen3},
      {"qwen3 d_wi", true, false, true, 0.f, 2048, 1536, 1024, qwen3},
      {"qwen3 d_wi accumulated", true, false, true, 1.f, 2048, 1536, 1024, qwen3},
      {"dsv3 up", false, false, false, 0.f, 256, 4096, 7168, dsv3},
      {"dsv3 down", false, false, false, 0.f, 256, 7168, 2048, dsv3},
      {"dsv3 d_a", false, true, false, 0.f, 256, 2048, 7168, dsv3},
      {"dsv3 d_wo", true, false, true, 0.f, 2048, 7168, 256, dsv3},
      {"dsv3 d_wi", true, false, true, 0.f, 7168, 4096, 256, dsv3},
      {"dsv3 d_wi accumulated", true, false, true, 1.f, 7168, 4096, 256, dsv3},
      {"dsv3 deferred d_wo", true, false, true, 0.f, 2048, 7168, 768, dsv3_deferred},
      {"dsv3 deferred d_wo accumulated", true, false, true, 1.f, 2048, 7168, 768, dsv3_deferred},
      {"dsv3 deferred d_wi", true, false, true, 0.f, 7168, 4096, 768, dsv3_deferred},
      {"dsv3 deferred d_wi accumulated", true, false, true, 1.f, 7168, 4096, 768, dsv3_deferred},
      {"te_seed up", false, false, false, 0.f, 8192, 8192, 1024, te_seed},
      {"te_seed down", false, false, false, 0.f, 8192, 1024, 4096, te_seed},
      {"te_seed d_a", false, true, false, 0.f, 8192, 4096, 1024, te_seed},
      {"te_seed d_X", false, true, false, 0.f, 8192, 1024, 8192, te_seed},
      {"mixtral down", false, false, false, 0.f, 4096, 4096, 14336, mixtral},
      {"mixtral d_X", false, true, false, 0.f, 4096, 4096, 28672, mixtral},
      {"mixtral d_wo", true, false, true, 0.f, 14336, 4096, 4096, mixtral},
      {"mixtral d_wo accumulated", true, false, true, 1.f, 14336, 4096, 4096, mixtral},
      {"mixtral d_wi", true, false, true, 0.f, 4096, 28672, 4096, mixtral},
  };
  for (const Case& c : cases) {
    const std::vector<int64_t>& rows = c.rows;
    const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
    // Per expert: A is [rows, k] (or [rows, m] for C = A^T B), B is [k, n] (or [n, k] with
    // trans_b, or [rows, n] for a weight gradient), C is [rows, n] (or [m, n]).
    const int64_t a_cols = c.trans_a ? c.m : c.k;
    const int64_t b_size = c.trans_a ? 0 : c.k * c.n;
    const int64_t b_total = c.trans_a ? total * c.n : b_size * static_cast<int64_t>(rows.size());
    const int64_t c_size = c.trans_a ? c.m * c.n : 0;
    const int64_t c_total = c.trans_a ? c_size * static_cast<int64_t>(rows.size()) : total * c.n;
    const size_t c_bytes = c.fp32_c ? 4 : 2;
    const std::vector<uint16_t> a = FloatsToBf16(FastRandomFloats(total * a_cols, 51));
    const std::vector<uint16_t> b = FloatsToBf16(FastRandomFloats(b_total, 52));
    std::vector<uint8_t> c0(c_total * c_bytes);
    {
      const std::vector<float> init = FastRandomFloats(c_total, 53);
      if (c.fp32_c) {
        std::memcpy(c0.data(), init.data(), c0.size());
      } else {
        const std::vector<uint16_t> init16 = FloatsToBf16(init);
        std::memcpy(c0.data(), init16.data(), c0.size());
      }
    }
    const int64_t before = cuda::TunedGemmPlansAdopted();
    const int64_t refused_before = cuda::TunedGemmPlansRefused();
    auto run = [&](bool tuned) -> absl::StatusOr<std::vector<uint8_t>> {
      CudaBackendOptions options;
      options.cublaslt_tuned = tuned;
      absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(0, options);
      if (!made.ok()) return made.status();
      Backend* gpu = made->get();
      ASSIGN_OR_RETURN(Buffer da, UploadTo(gpu, a));
      ASSIGN_OR_RETURN(Buffer db, UploadTo(gpu, b));
      ASSIGN_OR_RETURN(Buffer dc, UploadTo(gpu, c0));
      std::vector<GemmArgs> gemms;
      int64_t off = 0;
      for (size_t e = 0; e < rows.size(); ++e) {
        GemmArgs g;
        g.trans_a = c.trans_a, g.trans_b = c.trans_b;
        g.ab_type = DType::kBFloat16;
        g.c_type = c.fp32_c ? DType::kFloat32 : DType::kBFloat16;
        g.beta = c.beta;
        g.a = static_cast<const char*>(da.data()) + off * a_cols * 2, g.lda = a_cols;
        if (c.trans_a) {
          g.m = c.m, g.n = c.n, g.k = rows[e];
          g.b = static_cast<const char*>(db.data()) + off * c.n * 2, g.ldb = c.n;
          g.c = static_cast<char*>(dc.data()) + e * c_size * c_bytes, g.ldc = c.n;
        } else {
          g.m = rows[e], g.n = c.n, g.k = c.k;
          g.b = static_cast<const char*>(db.data()) + e * b_size * 2;
          g.ldb = c.trans_b ? c.k : c.n;
          g.c = static_cast<char*>(dc.data()) + off * c.n * c_bytes, g.ldc = c.n;
        }
        gemms.push_back(g);
        off += rows[e];
      }
      RETURN_IF_ERROR(gpu->GroupedGemm(gemms));
      std::vector<uint8_t> out(c0.size());
      RETURN_IF_ERROR(gpu->CopyToHost(out.data(), dc.data(), out.size()));
      return out;
    };
    absl::StatusOr<std::vector<uint8_t>> heuristic = run(false);
    ASSERT_TRUE(heuristic.ok()) << c.name << ": " << heuristic.status();
    EXPECT_EQ(cuda::TunedGemmPlansAdopted(), before)
        << c.name << ": cublaslt_tuned = false took one";
    absl::StatusOr<std::vector<uint8_t>> tuned = run(true);
    ASSERT_TRUE(tuned.ok()) << c.name << ": " << tuned.status();
    EXPECT_TRUE(*tuned == *heuristic) << c.name << ": the tuned plan changed the result";
    cudaDeviceProp prop;
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    if (cuda::TunedGemmsApply(prop.major, prop.minor, prop.multiProcessorCount,
                              cublasLtGetVersion())) {
      EXPECT_GT(cuda::TunedGemmPlansAdopted(), before) << c.name << ": no tuned plan taken";
      EXPECT_EQ(cuda::TunedGemmPlansRefused(), refused_before)
          << c.name << ": cuBLASLt refused a tuned plan at an exact shape";
    }
  }
}

// FP8 quantisation: the GPU's codes and scales are bitwise the CPU emulation's (docs/SPEC.md
// "FP8"), for fp32 and bf16 sources, both formats, as stored and transposed, several matrices
// with their own scales, ties, saturation-sized values and NaN.
TEST(CudaOps, QuantizeFp8IsBitwiseTheEmulation) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  struct Case {
    int64_t batch, rows, cols;
  };
  const Case cases[] = {{1, 1000, 256}, {3, 37, 53}, {2, 64, 96}, {1, 1, 8}, {4, 0, 16}};
  uint64_t seed = 900;
  for (const Case& qc : cases) {
    const int64_t n = qc.batch * qc.rows * qc.cols;
    std::vector<float> v = RandomFloats(n, seed++, 3.0f);
    if (n > 10) {
      v[1] = 1e30f;  // a matrix with a huge amax
      v[5] = -0.0f;
      v[7] = NAN;  // ignored by amax, stays NaN
    }
    for (DType src_type : {DType::kFloat32, DType::kBFloat16}) {
      Mirrored src = src_type == DType::kFloat32 ? bp.Upload(v) : bp.Upload(FloatsToBf16(v));
      for (DType fp8 : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (bool transpose : {false, true}) {
          Mirrored dst = bp.Output(std::max<int64_t>(n, 1));
          Mirrored scale = bp.Output(qc.batch * sizeof(float));
          Both(bp, [&](Backend* be, bool g) {
            QuantizeArgs q;
            q.src = P(src, g), q.src_type = src_type;
            q.batch = qc.batch, q.rows = qc.rows, q.cols = qc.cols, q.transpose = transpose;
            q.fp8 = fp8, q.dst = P(dst, g), q.scale = P<float>(scale, g);
            return be->QuantizeFp8(q);
          });
          Results<uint8_t> codes = bp.Download<uint8_t>(dst, n);
          Results<float> scales = bp.Download<float>(scale, qc.batch);
          SCOPED_TRACE(testing::Message()
                       << qc.batch << "x" << qc.rows << "x" << qc.cols << " " << DTypeName(src_type)
                       << "->" << DTypeName(fp8) << (transpose ? " transposed" : ""));
          EXPECT_EQ(std::memcmp(scales.cpu.data(), scales.gpu.data(), qc.batch * sizeof(float)), 0);
          // Equal values (NaN = NaN, -0 = +0: whether the hardware keeps the sign of an
          // underflow is not the emulation's business); codes that differ are counted too.
          int value_mismatches = 0, code_mismatches = 0;
          for (int64_t i = 0; i < n; ++i) {
            const float a = Fp8ToFloat(codes.cpu[i], fp8), b = Fp8ToFloat(codes.gpu[i], fp8);
            if (!(a == b || (std::isnan(a) && std::isnan(b)))) ++value_mismatches;
            if (codes.cpu[i] != codes.gpu[i]) ++code_mismatches;
          }
          EXPECT_EQ(value_mismatches, 0);
          if (code_mismatches > 0) {
            std::printf("QuantizeFp8: %d codes differ only as NaN payload or signed zero\n",
                        code_mismatches);
          }
        }
      }
    }
  }
}

// Group sizes of an expert layout: empty groups, none or some multiples of 16, and (many) more
// groups than one kernel launch takes (kMaxTableGroups = 512).
std::vector<int64_t> GroupRowsFor(int64_t groups, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> rows(groups);
  for (int64_t& r : rows) r = rng() % 5 == 0 ? 0 : static_cast<int64_t>(rng() % 40);
  return rows;
}

// The grouped transposed FP8 layout (QuantizeArgs::dst_grouped_t, the weight-gradient GEMMs'
// operands): the GPU's codes (both layouts, pads included) and scale are the emulation's.
// The e4m3 codes whose values differ between the two backends (every NaN code is one value).
int E4M3ValueMismatches(const Results<uint8_t>& codes) {
  int mismatches = 0;
  for (size_t i = 0; i < codes.cpu.size(); ++i) {
    const float a = Fp8ToFloat(codes.cpu[i], DType::kFloat8E4M3);
    const float b = Fp8ToFloat(codes.gpu[i], DType::kFloat8E4M3);
    if (!(a == b || (std::isnan(a) && std::isnan(b)))) ++mismatches;
  }
  return mismatches;
}

TEST(CudaOps, QuantizeFp8GroupedIsBitwiseTheEmulation) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  struct Case {
    std::vector<int64_t> group_rows;
    int64_t cols;
    bool with_rows;
  };
  const Case cases[] = {
      {{5, 0, 16, 1, 0, 17}, 53, true}, {{300, 0, 700}, 256, true}, {{300, 0, 700}, 96, false},
      {GroupRowsFor(700, 3), 64, true}, {{0, 0, 0}, 32, true},      {{}, 16, false}};
  uint64_t seed = 950;
  for (const Case& qc : cases) {
    const int64_t rows = std::accumulate(qc.group_rows.begin(), qc.group_rows.end(), int64_t{0});
    const int64_t n = rows * qc.cols, ld = Fp8GroupedColumns(qc.group_rows);
    std::vector<float> v = RandomFloats(n, seed++, 3.0f);
    if (n > 10) {
      v[1] = 1e30f;
      v[5] = -0.0f;
      v[7] = NAN;
    }
    for (DType src_type : {DType::kFloat32, DType::kBFloat16}) {
      Mirrored src = src_type == DType::kFloat32 ? bp.Upload(v) : bp.Upload(FloatsToBf16(v));
      Mirrored dst = bp.Output(std::max<int64_t>(n, 1));
      Mirrored grouped = bp.Output(std::max<int64_t>(qc.cols * ld, 1));
      Mirrored scale = bp.Output(sizeof(float));
      Both(bp, [&](Backend* be, bool g) {
        QuantizeArgs q;
        q.src = P(src, g), q.src_type = src_type, q.rows = rows, q.cols = qc.cols;
        q.dst = qc.with_rows ? P(dst, g) : nullptr, q.scale = P<float>(scale, g);
        q.dst_grouped_t = P(grouped, g), q.group_rows = qc.group_rows;
        return be->QuantizeFp8(q);
      });
      SCOPED_TRACE(testing::Message() << qc.group_rows.size() << " groups, " << rows << "x"
                                      << qc.cols << " " << DTypeName(src_type));
      Results<float> scales = bp.Download<float>(scale, 1);
      EXPECT_EQ(std::memcmp(scales.cpu.data(), scales.gpu.data(), sizeof(float)), 0);
      for (bool layout_rows : {true, false}) {
        if (layout_rows && !qc.with_rows) continue;
        Results<uint8_t> codes =
            bp.Download<uint8_t>(layout_rows ? dst : grouped, layout_rows ? n : qc.cols * ld);
        EXPECT_EQ(E4M3ValueMismatches(codes), 0)
            << (layout_rows ? "as stored" : "grouped transposed");
      }
    }
  }
}

// Delayed scaling (docs/SPEC.md "FP8"): Fp8HistoryAmax's amax and zeroed slot, then the grouped
// quantisation with that amax (saturating where the tensor outgrew it) reducing this step's
// amax into the slot inside its cast kernels: scale, codes and recorded amax bitwise the CPU's.
TEST(CudaOps, Fp8DelayedScalingIsBitwiseTheEmulation) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const std::vector<int64_t> group_rows = {5, 0, 300, 17};
  const int64_t rows = 322, ld = Fp8GroupedColumns(group_rows);
  for (int64_t cols : {64, 53}) {
    for (bool most_recent : {false, true}) {
      std::vector<float> v = RandomFloats(rows * cols, 960 + cols, 3.0f);
      v[3] = NAN;
      const std::vector<float> ring = {0.5f, 2.0f, 3.0f, 1.25f, 7.0f};
      Mirrored history = bp.Upload(ring);
      Mirrored src = bp.Upload(FloatsToBf16(v));
      Mirrored dst = bp.Output(rows * cols), grouped = bp.Output(cols * ld);
      Mirrored scale = bp.Output(4 * sizeof(float));
      Both(bp, [&](Backend* be, bool g) {
        Fp8HistoryArgs h;
        h.history = P<float>(history, g), h.len = 5, h.steps = 7, h.margin = 1;
        h.most_recent = most_recent, h.amax = P<float>(scale, g) + 2;
        absl::Status s = be->Fp8HistoryAmax(h);
        if (!s.ok()) return s;
        QuantizeArgs q;
        q.src = P(src, g), q.src_type = DType::kBFloat16, q.rows = rows, q.cols = cols;
        q.dst = P(dst, g), q.scale = P<float>(scale, g), q.amax = P<float>(scale, g) + 2;
        q.amax_out = P<float>(history, g) + 7 % 5;
        q.dst_grouped_t = P(grouped, g), q.group_rows = group_rows;
        return be->QuantizeFp8(q);
      });
      SCOPED_TRACE(testing::Message() << cols << " cols, most_recent " << most_recent);
      Results<float> scales = bp.Download<float>(scale, 4);
      EXPECT_EQ(std::memcmp(&scales.cpu[0], &scales.gpu[0], sizeof(float)), 0) << "scale";
      EXPECT_EQ(std::memcmp(&scales.cpu[2], &scales.gpu[2], sizeof(float)), 0) << "amax";
      EXPECT_EQ(scales.cpu[2], most_recent ? 4.0f : 14.0f);  // 2^1 x (slot 6 % 5 | the max)
      Results<float> after = bp.Download<float>(history, 5);
      EXPECT_EQ(std::memcmp(after.cpu.data(), after.gpu.data(), 5 * sizeof(float)), 0);
      EXPECT_GT(after.cpu[2], 0.0f) << "this step's amax in slot 7 % 5";
      for (bool layout_rows : {true, false}) {
        Results<uint8_t> codes = bp.Download<uint8_t>(layout_rows ? dst : grouped,
                                                      layout_rows ? rows * cols : cols * ld);
        EXPECT_EQ(E4M3ValueMismatches(codes), 0)
            << (layout_rows ? "as stored" : "grouped transposed");
      }
    }
  }
}

// The FP8 weight-gradient GEMMs as the layer runs them (moe_layer_experts.cc,
// ExpertWeightGradGemms): per expert C_e (+)= A_e . B_e^T on the grouped codes (k = the group's
// padded rows, zero pads), fp32 C written with beta 0 over stale NaNs (empty experts: zeros)
// and accumulated with beta 1, against the CPU emulation.
TEST(CudaOps, Fp8WeightGradGemmMatchesEmulation) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const std::vector<int64_t> group_rows = {0, 33, 1, 200, 17, 0, 64};
  const int64_t in_cols = 128, out_cols = 96, experts = group_rows.size();
  const int64_t rows = std::accumulate(group_rows.begin(), group_rows.end(), int64_t{0});
  const int64_t ld = Fp8GroupedColumns(group_rows);
  Mirrored in = bp.Upload(FloatsToBf16(RandomFloats(rows * in_cols, 41)));
  Mirrored d_out = bp.Upload(FloatsToBf16(RandomFloats(rows * out_cols, 42, 1e-3f)));
  Mirrored in_t = bp.Output(in_cols * ld), d_out_t = bp.Output(out_cols * ld);
  Mirrored scales = bp.Output(2 * kFp8ScaleStride * sizeof(float));
  Mirrored grad = bp.Upload(std::vector<float>(experts * in_cols * out_cols, NAN));
  for (float beta : {0.0f, 1.0f}) {
    Both(bp, [&](Backend* be, bool g) {
      QuantizeArgs q;
      q.src_type = DType::kBFloat16, q.rows = rows, q.group_rows = group_rows;
      q.src = P(in, g), q.cols = in_cols, q.dst_grouped_t = P(in_t, g);
      q.scale = P<float>(scales, g);
      absl::Status st = be->QuantizeFp8(q);
      if (!st.ok()) return st;
      q.src = P(d_out, g), q.cols = out_cols, q.dst_grouped_t = P(d_out_t, g);
      q.scale = P<float>(scales, g) + kFp8ScaleStride;
      st = be->QuantizeFp8(q);
      if (!st.ok()) return st;
      std::vector<GemmArgs> gemms;
      int64_t column = 0;
      for (int64_t e = 0; e < experts; ++e) {
        GemmArgs a;
        a.trans_b = true;
        a.m = in_cols, a.n = out_cols, a.k = Fp8PaddedRows(group_rows[e]);
        a.a = P<uint8_t>(in_t, g) + column, a.lda = ld;
        a.b = P<uint8_t>(d_out_t, g) + column, a.ldb = ld;
        a.c = P<float>(grad, g) + e * in_cols * out_cols, a.ldc = out_cols;
        a.c_type = DType::kFloat32, a.beta = beta;
        a.a_fp8 = a.b_fp8 = DType::kFloat8E4M3;
        a.a_scale = P<float>(scales, g), a.b_scale = P<float>(scales, g) + kFp8ScaleStride;
        gemms.push_back(a);
        column += a.k;
      }
      return be->GroupedGemm(gemms);
    });
    // As Fp8GemmMatchesEmulation's fp32 out (the MMA's reduced-precision accumulation between
    // promotions), over k up to 208.
    EXPECT_LE(MaxRelError(bp.Download<float>(grad, experts * in_cols * out_cols)), 2e-3)
        << "beta " << beta;
  }
}

// FP8 GEMMs (A . B^T, e4m3 x e4m3 and e5m2 x e4m3, bf16 and fp32 out, grouped with per-expert
// scales) against the CPU emulation.
TEST(CudaOps, Fp8GemmMatchesEmulation) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const int64_t n = 96, k = 128, experts = 5;
  std::vector<int64_t> rows = {0, 33, 1, 200, 17};
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  Mirrored X = bp.Upload(FloatsToBf16(RandomFloats(total * k, 31)));
  Mirrored W = bp.Upload(RandomFloats(experts * n * k, 32, 0.05f));
  Mirrored Xq = bp.Output(total * k), Wq = bp.Output(experts * n * k);
  Mirrored xs = bp.Output(sizeof(float));
  Mirrored ws = bp.Output(experts * kFp8ScaleStride * sizeof(float));
  for (DType a_fp8 : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    for (DType c_type : {DType::kBFloat16, DType::kFloat32}) {
      Mirrored Y = bp.Output(total * n * 4);
      Both(bp, [&](Backend* be, bool g) {
        QuantizeArgs q;
        q.src = P(X, g), q.src_type = DType::kBFloat16, q.rows = total, q.cols = k;
        q.fp8 = a_fp8, q.dst = P(Xq, g), q.scale = P<float>(xs, g);
        absl::Status st = be->QuantizeFp8(q);
        if (!st.ok()) return st;
        q.src = P(W, g), q.src_type = DType::kFloat32, q.batch = experts, q.rows = n;
        q.fp8 = DType::kFloat8E4M3, q.dst = P(Wq, g), q.scale = P<float>(ws, g);
        q.scale_stride = kFp8ScaleStride;
        st = be->QuantizeFp8(q);
        if (!st.ok()) return st;
        std::vector<GemmArgs> gemms;
        int64_t off = 0;
        for (int64_t e = 0; e < experts; ++e) {
          GemmArgs a;
          a.trans_b = true;
          a.m = rows[e], a.n = n, a.k = k;
          a.a = P<uint8_t>(Xq, g) + off * k, a.lda = k;
          a.b = P<uint8_t>(Wq, g) + e * n * k, a.ldb = k;
          a.c = P<char>(Y, g) + off * n * DTypeSize(c_type), a.ldc = n;
          a.c_type = c_type;
          a.a_fp8 = a_fp8, a.b_fp8 = DType::kFloat8E4M3;
          a.a_scale = P<float>(xs, g), a.b_scale = P<float>(ws, g) + e * kFp8ScaleStride;
          gemms.push_back(a);
          off += rows[e];
        }
        return be->GroupedGemm(gemms);
      });
      Results<float> r = c_type == DType::kBFloat16 ? bp.DownloadBf16(Y, total * n)
                                                    : bp.Download<float>(Y, total * n);
      // fp32 out: Hopper's FP8 MMA accumulates with fewer bits than fp32 between cuBLASLt's
      // promotions (measured 3.5e-4 of the largest value at k = 128), so not 1e-4 as for bf16/fp32
      // operands.
      EXPECT_LE(MaxRelError(r), c_type == DType::kBFloat16 ? 1e-2 : 1e-3)
          << DTypeName(a_fp8) << " -> " << DTypeName(c_type);
    }
  }
}

TEST(CudaOps, ConvertAddOptimizer) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const int64_t n = 10007;
  std::vector<float> x = RandomFloats(n, 5);
  Mirrored X = bp.Upload(x), XB = bp.Output(n * 2), X2 = bp.Output(n * 4);
  Both(bp, [&](Backend* be, bool g) {
    absl::Status s = be->Convert(P(X, g), DType::kFloat32, P(XB, g), DType::kBFloat16, n);
    if (!s.ok()) return s;
    return be->Convert(P(XB, g), DType::kBFloat16, P(X2, g), DType::kFloat32, n);
  });
  Results<uint16_t> xb = bp.Download<uint16_t>(XB, n);
  EXPECT_EQ(xb.cpu, xb.gpu) << "bf16 rounding differs";
  EXPECT_EQ(MaxRelError(bp.Download<float>(X2, n)), 0.0);

  Mirrored D = bp.Upload(RandomFloats(n, 6));
  Both(bp, [&](Backend* be, bool g) { return be->AddInPlace(P<float>(D, g), P<float>(X, g), n); });
  EXPECT_EQ(MaxRelError(bp.Download<float>(D, n)), 0.0);

  for (int variant = 0; variant < 6; ++variant) {  // 3..5: with a data-parallel grad_scale
    Backend::OptimizerArgs args;
    args.adamw = variant % 3 == 2;
    args.lr = 0.01, args.momentum = variant % 3 == 1 ? 0.9 : 0.0, args.weight_decay = 0.1;
    args.step = 3;
    args.grad_scale = variant >= 3 ? 1.0 / 3 : 1.0;
    Mirrored Pm = bp.Upload(RandomFloats(n, 7)), G = bp.Upload(RandomFloats(n, 8));
    Mirrored M = bp.Upload(RandomFloats(n, 9, 0.1f)), V = bp.Upload(RandomFloats(n, 10, 0.0f));
    Both(bp, [&](Backend* be, bool g) {
      return be->OptimizerStep(args, P<float>(Pm, g), P<float>(G, g),
                               variant % 3 == 0 ? nullptr : P<float>(M, g),
                               args.adamw ? P<float>(V, g) : nullptr, n);
    });
    // The CPU backend steps in double; AdamW's divisions round differently in fp32.
    const double tol = args.adamw ? 5e-5 : 1e-6;
    EXPECT_LE(MaxRelError(bp.Download<float>(Pm, n)), tol) << "variant " << variant;
    if (variant % 3 > 0) {
      EXPECT_LE(MaxRelError(bp.Download<float>(M, n)), tol);
    }
    if (args.adamw) {
      EXPECT_LE(MaxRelError(bp.Download<float>(V, n)), tol);
    }
  }
}

struct RouterCase {
  const char* name;
  ScoreFunction score;
  bool pre;
  int64_t T, E, k, groups, group_topk;
  double scaling;
  bool bias;
};

TEST(CudaOps, RouterMatchesCpu) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const RouterCase cases[] = {
      {"softmax_post", ScoreFunction::kSoftmax, false, 128, 32, 4, 0, 0, 1.0, false},
      {"softmax_pre", ScoreFunction::kSoftmax, true, 2048, 32, 4, 0, 0, 1.2, false},
      {"softmax_grouped", ScoreFunction::kSoftmax, false, 2048, 128, 8, 8, 4, 1.0, false},
      {"sigmoid_bias_grouped", ScoreFunction::kSigmoid, false, 7168, 128, 4, 8, 4, 1.2, true},
      {"sigmoid_k8", ScoreFunction::kSigmoid, false, 7168, 32, 8, 0, 0, 1.0, false},
      {"sigmoid_k1", ScoreFunction::kSigmoid, false, 100, 8, 1, 0, 0, 1.0, true},
      {"dsv3", ScoreFunction::kSigmoid, false, 512, 256, 8, 8, 4, 2.5, true},
      {"empty", ScoreFunction::kSoftmax, false, 0, 8, 2, 0, 0, 1.0, false},
  };
  uint64_t seed = 100;
  for (const RouterCase& rc : cases) {
    SCOPED_TRACE(rc.name);
    LayerConfig c;
    c.hidden = 16, c.ffn = 16, c.num_experts = rc.E, c.top_k = rc.k;
    c.score_function = rc.score, c.pre_softmax = rc.pre, c.num_groups = rc.groups;
    c.group_topk = rc.group_topk, c.scaling_factor = rc.scaling, c.use_expert_bias = rc.bias;
    const int64_t T = rc.T, E = rc.E, K = rc.k;
    Mirrored Z = bp.Upload(RandomFloats(T * E, seed++, 2.0f));
    Mirrored Bias = bp.Upload(RandomFloats(E, seed++, 0.1f));
    Mirrored TopE = bp.Output(T * K * 4), TopW = bp.Output(T * K * 4);
    Mirrored S = bp.Output(T * E * 4), L = bp.Output(T * 4), Cnt = bp.Output(E * 4);
    Mirrored Loss = bp.Output((E + 1) * 8);
    Both(bp, [&](Backend* be, bool g) {
      RouterForwardArgs a;
      a.config = &c, a.tokens = T, a.logits = P<float>(Z, g);
      a.expert_bias = rc.bias ? P<float>(Bias, g) : nullptr;
      a.topk_expert = P<int32_t>(TopE, g), a.topk_weight = P<float>(TopW, g);
      a.scores = P<float>(S, g), a.logsumexp = P<float>(L, g);
      a.expert_counts = P<int32_t>(Cnt, g), a.loss_partials = P<double>(Loss, g);
      return be->RouterForward(a);
    });
    Results<int32_t> top = bp.Download<int32_t>(TopE, T * K);
    EXPECT_EQ(top.cpu, top.gpu) << "selected experts / slot order differ";
    EXPECT_LE(MaxRelError(bp.Download<float>(TopW, T * K)), 1e-5);
    EXPECT_LE(MaxRelError(bp.Download<float>(S, T * E)), 1e-5);
    EXPECT_LE(MaxRelError(bp.Download<float>(L, T)), 1e-5);
    Results<int32_t> cnt = bp.Download<int32_t>(Cnt, E);
    EXPECT_EQ(cnt.cpu, cnt.gpu);
    Results<double> loss = bp.Download<double>(Loss, E + 1);
    for (int64_t e = 0; e <= E; ++e) {
      EXPECT_NEAR(loss.gpu[e], loss.cpu[e], 1e-5 * std::max(1.0, std::fabs(loss.cpu[e])))
          << "loss partial " << e;
    }
    // Backward with aux and z-loss terms.
    Mirrored DW = bp.Upload(RandomFloats(T * K, seed++));
    Mirrored Aux = bp.Upload(RandomFloats(E, seed++, 0.01f));
    Mirrored DZ = bp.Output(T * E * 4);
    Both(bp, [&](Backend* be, bool g) {
      RouterBackwardArgs a;
      a.config = &c, a.tokens = T, a.logits = P<float>(Z, g), a.scores = P<float>(S, g);
      a.logsumexp = P<float>(L, g), a.topk_expert = P<int32_t>(TopE, g);
      a.d_topk_weight = P<float>(DW, g), a.aux_grad = P<float>(Aux, g);
      a.z_loss_grad_scale = 1e-3, a.d_logits = P<float>(DZ, g);
      return be->RouterBackward(a);
    });
    EXPECT_LE(MaxRelError(bp.Download<float>(DZ, T * E)), 1e-4);
  }
}

TEST(CudaOps, PlanPermuteGatherCombine) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const int64_t T = 3000, K = 4, E = 16, W = 40;
  std::mt19937_64 rng(11);
  std::vector<int32_t> experts(T * K);
  std::vector<float> weights(T * K);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    // Distinct experts per token, skewed toward low indices so that capacity drops some.
    std::sort(perm.begin(), perm.begin() + K + 4);
    for (int64_t j = 0; j < K; ++j) {
      experts[t * K + j] = perm[j];
      weights[t * K + j] = static_cast<float>(rng() % 8) / 8.0f;  // many ties
    }
  }
  Mirrored Ex = bp.Upload(experts), Wt = bp.Upload(weights);
  for (int64_t capacity : {int64_t{-1}, int64_t{700}, int64_t{0}}) {
    SCOPED_TRACE(capacity);
    Mirrored Kept = bp.Output(T * K), KC = bp.Output(E * 4);
    Both(bp, [&](Backend* be, bool g) {
      RoutePlanArgs a;
      a.tokens = T, a.top_k = K, a.num_experts = E, a.capacity = capacity;
      a.topk_expert = P<int32_t>(Ex, g), a.topk_weight = P<float>(Wt, g);
      a.kept = P<uint8_t>(Kept, g), a.kept_counts = P<int32_t>(KC, g);
      return be->RoutePlan(a);
    });
    Results<uint8_t> kept = bp.Download<uint8_t>(Kept, T * K);
    ASSERT_EQ(kept.cpu, kept.gpu);
    Results<int32_t> kc = bp.Download<int32_t>(KC, E);
    ASSERT_EQ(kc.cpu, kc.gpu);
    // Permute with align 8.
    std::vector<int64_t> offsets(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (kc.cpu[e] + 7) / 8 * 8;
    const int64_t rows = offsets[E];
    Mirrored Off = bp.Upload(offsets), PR = bp.Output(T * K * 4), RT = bp.Output(rows * 4);
    Both(bp, [&](Backend* be, bool g) {
      PermuteArgs a;
      a.tokens = T, a.top_k = K, a.num_experts = E, a.total_rows = rows;
      a.topk_expert = P<int32_t>(Ex, g), a.kept = P<uint8_t>(Kept, g);
      a.expert_offsets = P<int64_t>(Off, g), a.pair_row = P<int32_t>(PR, g);
      a.row_token = P<int32_t>(RT, g);
      return be->Permute(a);
    });
    Results<int32_t> pr = bp.Download<int32_t>(PR, T * K), rt = bp.Download<int32_t>(RT, rows);
    ASSERT_EQ(pr.cpu, pr.gpu);
    ASSERT_EQ(rt.cpu, rt.gpu);
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      const size_t es = DTypeSize(dt);
      std::vector<float> xf = RandomFloats(T * W, 12);
      Mirrored X = dt == DType::kBFloat16 ? bp.Upload(FloatsToBf16(xf)) : bp.Upload(xf);
      Mirrored G = bp.Output(rows * W * es);
      Both(bp, [&](Backend* be, bool g) {
        return be->GatherRows(P(X, g), P<int32_t>(RT, g), rows, W, dt, P(G, g));
      });
      Results<uint8_t> gr = bp.Download<uint8_t>(G, rows * W * es);
      ASSERT_EQ(gr.cpu, gr.gpu);
      // The token-side scatter gives the gather's bytes (padding rows zero, dropped pairs
      // skipped) on both backends.
      Mirrored S = bp.Output(rows * W * es);
      Both(bp, [&](Backend* be, bool g) {
        return be->ScatterTokenRows(P(X, g), P<int32_t>(PR, g), T, K, P<int32_t>(RT, g), rows, W,
                                    dt, P(S, g));
      });
      Results<uint8_t> sc = bp.Download<uint8_t>(S, rows * W * es);
      ASSERT_EQ(sc.gpu, gr.gpu);
      ASSERT_EQ(sc.cpu, gr.cpu);
      // Row blocks: reverse the order of 5 blocks.
      std::vector<RowBlock> blocks;
      const int64_t part = rows / 5;
      for (int i = 0; i < 5; ++i) blocks.push_back(RowBlock{i * part, (4 - i) * part, part});
      Mirrored Moved = bp.Upload(std::vector<uint8_t>(rows * W * es, 0));
      Both(bp, [&](Backend* be, bool g) {
        return be->CopyRowBlocks(P(G, g), P(Moved, g), W * es, blocks);
      });
      Results<uint8_t> mv = bp.Download<uint8_t>(Moved, rows * W * es);
      ASSERT_EQ(mv.cpu, mv.gpu);
      // Combine and its backward (y in dt, out fp32 and dt).
      for (DType out_t : {DType::kFloat32, dt}) {
        Mirrored Out = bp.Output(T * W * DTypeSize(out_t));
        Both(bp, [&](Backend* be, bool g) {
          return be->CombineRows(P(G, g), dt, P<int32_t>(PR, g), P<float>(Wt, g), T, K, W,
                                 P(Out, g), out_t);
        });
        Results<float> out = out_t == DType::kBFloat16 ? bp.DownloadBf16(Out, T * W)
                                                       : bp.Download<float>(Out, T * W);
        EXPECT_LE(MaxRelError(out), out_t == DType::kBFloat16 ? 8e-3 : 1e-6);
      }
      std::vector<float> df = RandomFloats(T * W, 13);
      Mirrored DOut = dt == DType::kBFloat16 ? bp.Upload(FloatsToBf16(df)) : bp.Upload(df);
      Mirrored DY = bp.Output(rows * W * es), DWt = bp.Output(T * K * 4);
      Both(bp, [&](Backend* be, bool g) {
        return be->CombineBackward(P(DOut, g), dt, P(G, g), dt, P<int32_t>(PR, g), P<float>(Wt, g),
                                   T, K, W, rows, P(DY, g), P<float>(DWt, g));
      });
      Results<float> dy =
          dt == DType::kBFloat16 ? bp.DownloadBf16(DY, rows * W) : bp.Download<float>(DY, rows * W);
      EXPECT_LE(MaxRelError(dy), dt == DType::kBFloat16 ? 8e-3 : 1e-6);
      EXPECT_LE(MaxRelError(bp.Download<float>(DWt, T * K)), 1e-5);
    }
  }
}

TEST(CudaOps, ActivationsAndBiases) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const std::vector<int64_t> groups = {5, 0, 17, 9, 33};
  const int64_t rows = 64;  // all groups' rows
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (Activation act :
         {Activation::kSilu, Activation::kGelu, Activation::kRelu, Activation::kLinear}) {
      for (bool gated : {true, false}) {
        for (int64_t F : {int64_t{48}, int64_t{13}}) {
          SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " act=" << ActivationName(act)
                                            << " gated=" << gated << " F=" << F);
          const int64_t up = gated ? 2 * F : F;
          const size_t es = DTypeSize(dt);
          const bool bf = dt == DType::kBFloat16;
          std::vector<float> h = RandomFloats(rows * up, 20), da = RandomFloats(rows * F, 21);
          Mirrored Hm = bf ? bp.Upload(FloatsToBf16(h)) : bp.Upload(h);
          Mirrored Bias = bp.Upload(RandomFloats(groups.size() * up, 22, 0.5f));
          Mirrored A = bp.Output(rows * F * es);
          Mirrored DA = bf ? bp.Upload(FloatsToBf16(da)) : bp.Upload(da);
          Mirrored DH = bp.Output(rows * up * es);
          Both(bp, [&](Backend* be, bool g) {
            ActivationArgs a;
            a.activation = act, a.gated = gated, a.rows = rows, a.ffn = F, a.dtype = dt;
            a.h = P(Hm, g), a.a = P(A, g), a.up_bias = P<float>(Bias, g), a.group_rows = groups;
            absl::Status s = be->ActivationForward(a);
            if (!s.ok()) return s;
            a.d_a = P(DA, g), a.d_h = P(DH, g);
            return be->ActivationBackward(a);
          });
          const double tol = bf ? 8e-3 : 1e-5;
          auto down = [&](const Mirrored& m, size_t n) {
            return bf ? bp.DownloadBf16(m, n) : bp.Download<float>(m, n);
          };
          EXPECT_LE(MaxRelError(down(Hm, rows * up)), tol) << "h + bias";
          EXPECT_LE(MaxRelError(down(A, rows * F)), tol) << "a";
          EXPECT_LE(MaxRelError(down(DH, rows * up)), tol) << "d_h";
          // Bias gradient over the groups (fp32 accumulation).
          Mirrored DB = bp.Upload(RandomFloats(groups.size() * up, 23));
          Both(bp, [&](Backend* be, bool g) {
            return be->GroupBiasGrad(P(DH, g), dt, up, groups, P<float>(DB, g));
          });
          EXPECT_LE(MaxRelError(bp.Download<float>(DB, groups.size() * up)), 1e-5);
          Both(bp, [&](Backend* be, bool g) {
            return be->AddGroupBias(P(DH, g), dt, P<float>(Bias, g), up, groups);
          });
          EXPECT_LE(MaxRelError(down(DH, rows * up)), tol) << "AddGroupBias";
        }
      }
    }
  }
}

// ActivationArgs::amax (FP8: the activation kernels find the amax of what they store): on each
// backend it is max |a| (forward) and max |d_h| (backward) of the stored values bitwise, and a
// QuantizeFp8 given it writes the scale and codes of one that computes its own.
TEST(CudaOps, Fp8ActivationAmaxIsTheQuantiseAmax) {
  BackendPair bp;
  REQUIRE_GPU(bp);
  const int64_t rows = 300;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (bool gated : {true, false}) {
      for (int64_t F : {int64_t{48}, int64_t{13}}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " gated=" << gated << " F=" << F);
        const int64_t up = gated ? 2 * F : F;
        const bool bf = dt == DType::kBFloat16;
        std::vector<float> h = RandomFloats(rows * up, 24, 2.0f), da = RandomFloats(rows * F, 25);
        h[7] = NAN;  // NaN is not an amax
        Mirrored Hm = bf ? bp.Upload(FloatsToBf16(h)) : bp.Upload(h);
        Mirrored DA = bf ? bp.Upload(FloatsToBf16(da)) : bp.Upload(da);
        Mirrored A = bp.Output(rows * F * DTypeSize(dt)), DH = bp.Output(rows * up * DTypeSize(dt));
        Mirrored amax = bp.Upload(std::vector<float>(2 * kFp8ScaleStride, 0.0f));
        Both(bp, [&](Backend* be, bool g) {
          ActivationArgs a;
          a.activation = Activation::kSilu, a.gated = gated, a.rows = rows, a.ffn = F, a.dtype = dt;
          a.h = P(Hm, g), a.a = P(A, g), a.d_a = P(DA, g), a.d_h = P(DH, g);
          a.amax = P<float>(amax, g);
          absl::Status s = be->ActivationForward(a);
          if (!s.ok()) return s;
          a.amax = P<float>(amax, g) + kFp8ScaleStride;
          return be->ActivationBackward(a);
        });
        Results<float> found = bp.Download<float>(amax, 2 * kFp8ScaleStride);
        for (int which = 0; which < 2; ++which) {
          const Mirrored& out = which == 0 ? A : DH;
          const int64_t n = rows * (which == 0 ? F : up);
          Results<float> values = bf ? bp.DownloadBf16(out, n) : bp.Download<float>(out, n);
          for (bool gpu : {false, true}) {
            float want = 0.0f;
            for (float v : gpu ? values.gpu : values.cpu) want = std::fmax(want, std::fabs(v));
            const float got = (gpu ? found.gpu : found.cpu)[which * kFp8ScaleStride];
            EXPECT_EQ(got, want) << (which == 0 ? "a" : "d_h") << (gpu ? " gpu" : " cpu");
          }
          Mirrored codes = bp.Output(2 * n), scales = bp.Output(2 * kFp8ScaleStride * 4);
          Both(bp, [&](Backend* be, bool g) {
            QuantizeArgs q;
            q.src = P(out, g), q.src_type = dt, q.rows = rows, q.cols = n / rows;
            q.dst = P(codes, g), q.scale = P<float>(scales, g);
            absl::Status s = be->QuantizeFp8(q);
            if (!s.ok()) return s;
            q.amax = P<float>(amax, g) + which * kFp8ScaleStride;
            q.dst = P<uint8_t>(codes, g) + n, q.scale = P<float>(scales, g) + kFp8ScaleStride;
            return be->QuantizeFp8(q);
          });
          Results<uint8_t> c = bp.Download<uint8_t>(codes, 2 * n);
          Results<float> sc = bp.Download<float>(scales, 2 * kFp8ScaleStride);
          for (bool gpu : {false, true}) {
            const std::vector<uint8_t>& cv = gpu ? c.gpu : c.cpu;
            const std::vector<float>& sv = gpu ? sc.gpu : sc.cpu;
            EXPECT_EQ(sv[0], sv[kFp8ScaleStride]) << (gpu ? "gpu" : "cpu");
            EXPECT_EQ(std::memcmp(cv.data(), cv.data() + n, n), 0) << (gpu ? "gpu" : "cpu");
          }
        }
      }
    }
  }
}

TEST(CudaOps, LargeHostCopiesRoundTrip) {
  // Both the driver's pageable copies and the backend's opt-in pinned staging.
  for (bool staging : {false, true}) {
    CudaBackendOptions options;
    options.host_staging = staging;
    BackendPair bp(options);
    REQUIRE_GPU(bp);
    Backend* gpu = bp.gpu();
    // Sizes around the staging chunk (32 MiB) and the staged-copy threshold (4 MiB).
    for (size_t bytes : {size_t{5} << 20, (size_t{32} << 20) + 12345, (size_t{100} << 20) + 7}) {
      SCOPED_TRACE(::testing::Message() << bytes << " bytes, staging " << staging);
      std::vector<uint8_t> a(bytes), b(bytes);
      std::mt19937_64 rng(bytes);
      for (auto& v : a) v = static_cast<uint8_t>(rng());
      for (auto& v : b) v = static_cast<uint8_t>(rng());
      Buffer da = gpu->Allocate(bytes).value(), db = gpu->Allocate(bytes).value();
      Buffer dc = gpu->Allocate(bytes).value();
      // Two uploads back to back (staging slots reused), a device copy, two downloads.
      ASSERT_TRUE(gpu->CopyFromHost(da.data(), a.data(), bytes).ok());
      ASSERT_TRUE(gpu->CopyFromHost(db.data(), b.data(), bytes).ok());
      a.assign(bytes, 0);  // the host source may be reused as soon as the call returns
      ASSERT_TRUE(gpu->Copy(dc.data(), da.data(), bytes).ok());
      std::vector<uint8_t> out_b(bytes, 1), out_c(bytes, 2);
      ASSERT_TRUE(gpu->CopyToHost(out_b.data(), db.data(), bytes).ok());
      ASSERT_TRUE(gpu->CopyToHost(out_c.data(), dc.data(), bytes).ok());
      EXPECT_TRUE(out_b == b) << "second upload/download differs";
      std::mt19937_64 again(bytes);
      std::vector<uint8_t> expect_a(bytes);
      for (auto& v : expect_a) v = static_cast<uint8_t>(again());
      EXPECT_TRUE(out_c == expect_a) << "first upload (then device copy) differs";
    }
  }
}

// CUDA IPC (moe.v1 RegisterCudaSharedMemory): a handle exported by another process opens, and
// a region declared larger than the allocation it shares is refused instead of letting the
// worker read and write past it. The exporting process is this binary again
// (CudaIpc.ExporterChild, run only with MOED_IPC_CHILD set): it prints its handle in hex and
// keeps the allocation alive until its stdin closes.
constexpr size_t kIpcBytes = 1 << 20;

TEST(CudaIpc, ExporterChild) {
  if (std::getenv("MOED_IPC_CHILD") == nullptr) GTEST_SKIP() << "the other process's half";
  absl::StatusOr<void*> memory = AllocateSharableDeviceMemory(0, kIpcBytes);
  ASSERT_TRUE(memory.ok()) << memory.status();
  absl::StatusOr<std::string> handle = CudaIpcHandleOf(*memory);
  ASSERT_TRUE(handle.ok()) << handle.status();
  std::string hex;
  for (unsigned char c : *handle) hex += absl::StrFormat("%02x", c);
  std::printf("HANDLE %s\n", hex.c_str());
  std::fflush(stdout);
  char byte;
  while (read(0, &byte, 1) > 0) {
  }
  FreeDeviceMemory(*memory).IgnoreError();
}

TEST(CudaIpc, OpensAnotherProcesssAllocationAndRefusesAShortOne) {
  if (std::getenv("MOED_IPC_CHILD") != nullptr) GTEST_SKIP();
  BackendPair bp;
  REQUIRE_GPU(bp);
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    close(to_child[1]);
    close(from_child[0]);
    setenv("MOED_IPC_CHILD", "1", 1);
    execl("/proc/self/exe", "cuda_backend_ops_test", "--gtest_filter=CudaIpc.ExporterChild",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  FILE* out = fdopen(from_child[0], "r");
  std::string handle;
  char line[512];
  while (handle.empty() && std::fgets(line, sizeof(line), out) != nullptr) {
    absl::string_view l(line);
    if (absl::ConsumePrefix(&l, "HANDLE ")) {
      for (size_t i = 0; i + 1 < l.size() && std::isxdigit(l[i]); i += 2) {
        handle.push_back(static_cast<char>(std::stoi(std::string(l.substr(i, 2)), nullptr, 16)));
      }
    }
  }
  ASSERT_EQ(handle.size(), 64u) << "no handle from the exporting process";
  absl::StatusOr<void*> too_big = OpenCudaIpcHandle(handle, 0, kIpcBytes + 1);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kFailedPrecondition) << too_big.status();
  absl::StatusOr<void*> opened = OpenCudaIpcHandle(handle, 0, kIpcBytes);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::vector<char> back(16);
  EXPECT_TRUE(CopyMemory(back.data(), *opened, back.size()).ok());
  EXPECT_TRUE(CloseCudaIpcHandle(*opened).ok());
  close(to_child[1]);  // the child frees its allocation and exits
  int status = 0;
  waitpid(child, &status, 0);
  std::fclose(out);
}

}  // namespace
}  // namespace gpu_test
}  // namespace moe
