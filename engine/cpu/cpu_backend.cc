#include "engine/cpu/cpu_backend.h"

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/parallel.h"

namespace moe {
namespace {

constexpr size_t kAlignment = 64;

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(threads) {}

  std::string name() const override { return "cpu"; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  // No speed to measure: a deterministic rule (engine/fp8_gemms.h) that gives small test
  // layers both kinds of GEMM.
  bool Fp8GemmPays(const Fp8GemmShape& shape) const override { return CpuFp8GemmPays(shape); }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override {
    // Never a null pointer, even for 0 bytes: callers pass buffers of empty steps around.
    // A size within kAlignment of SIZE_MAX would wrap to a tiny block in the rounding below.
    if (bytes > SIZE_MAX - kAlignment) {
      return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
    }
    const size_t rounded = ((bytes + kAlignment - 1) / kAlignment + (bytes == 0)) * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
    }
    const size_t now = allocated_.fetch_add(rounded) + rounded;
    size_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return Buffer(p, bytes, [this, rounded](void* q) {
      allocated_.fetch_sub(rounded);
      std::free(q);
    });
  }
  absl::Status CopyFromHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes);
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("Copy: null pointer");
    if (dst != src) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Memset(void* dst, int value, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr) return absl::InvalidArgumentError("Memset: null pointer");
    std::memset(dst, value, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  size_t allocated_bytes() const override { return allocated_.load(); }
  size_t peak_allocated_bytes() const override { return peak_.load(); }

  absl::Status Gemm(const GemmArgs& args) override { return cpu::Gemm(args, threads_); }
  // A null a with a_bf16 given is widened in the GEMM (cpu_gemm.cc): the same values as the
  // fp32 copy the layer then does not keep, so the same bits.
  bool GemmReadsBf16A() const override { return true; }
  absl::Status QuantizeFp8(const QuantizeArgs& args) override {
    return cpu::QuantizeFp8(args, threads_);
  }
  absl::Status Fp8HistoryAmax(const Fp8HistoryArgs& args) override {
    return cpu::Fp8HistoryAmax(args);
  }

  absl::Status Convert(const void* src, DType src_type, void* dst, DType dst_type,
                       int64_t count) override {
    if (count < 0) return absl::InvalidArgumentError("Convert: negative count");
    if (count == 0) return absl::OkStatus();
    if (src_type == dst_type) return Copy(dst, src, static_cast<size_t>(count) * DTypeSize(src_type));
    if (absl::Status s = cpu::CheckFloatType("Convert", "src_type", src_type); !s.ok()) return s;
    if (absl::Status s = cpu::CheckFloatType("Convert", "dst_type", dst_type); !s.ok()) return s;
    cpu::ParallelFor(threads_, count, 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        cpu::StoreFloat(dst, dst_type, i, cpu::LoadFloat(src, src_type, i));
      }
    });
    return absl::OkStatus();
  }

  absl::Status AddInPlace(float* dst, const float* src, int64_t count) override {
    if (count < 0) return absl::InvalidArgumentError("AddInPlace: negative count");
    for (int64_t i = 0; i < count; ++i) dst[i] += src[i];
    return absl::OkStatus();
  }

  absl::Status RouterForward(const RouterForwardArgs& args) override {
    return cpu::RouterForward(args, threads_);
  }
  absl::Status RouterBackward(const RouterBackwardArgs& args) override {
    return cpu::RouterBackward(args, threads_);
  }
  absl::Status RoutePlan(const RoutePlanArgs& args) override { return cpu::RoutePlan(args); }
  absl::Status Permute(const PermuteArgs& args) override { return cpu::Permute(args); }
  absl::Status GatherRows(const void* src, const int32_t* index, int64_t rows, int64_t width,
                          DType dtype, void* dst) override {
    return cpu::GatherRows(src, index, rows, width, dtype, dst, threads_);
  }
  absl::Status CopyRowBlocks(const void* src, void* dst, size_t row_bytes,
                             absl::Span<const RowBlock> blocks) override {
    for (const RowBlock& b : blocks) {
      if (b.rows < 0 || b.src_row < 0 || b.dst_row < 0) {
        return absl::InvalidArgumentError("CopyRowBlocks: negative block");
      }
      if (b.rows == 0) continue;
      std::memcpy(static_cast<char*>(dst) + b.dst_row * row_bytes,
                  static_cast<const char*>(src) + b.src_row * row_bytes, b.rows * row_bytes);
    }
    return absl::OkStatus();
  }
  absl::Status CombineRows(const void* y, DType y_type, const int32_t* pair_row,
                           const float* weight, int64_t tokens, int64_t top_k, int64_t width,
                           void* out, DType out_type) override {
    return cpu::CombineRows(y, y_type, pair_row, weight, tokens, top_k, width, out, out_type,
                            threads_);
  }
  absl::Status CombineBackward(const void* d_out, DType d_out_type, const void* y, DType y_type,
                               const int32_t* pair_row, const float* weight, int64_t tokens,
                               int64_t top_k, int64_t width, int64_t total_rows, void* d_y,
                               float* d_weight) override {
    return cpu::CombineBackward(d_out, d_out_type, y, y_type, pair_row, weight, tokens, top_k,
                                width, total_rows, d_y, d_weight, threads_);
  }
  absl::Status ActivationForward(const ActivationArgs& args) override {
    return cpu::ActivationForward(args, threads_);
  }
  absl::Status ActivationBackward(const ActivationArgs& args) override {
    return cpu::ActivationBackward(args, threads_);
  }
  absl::Status AddGroupBias(void* y, DType dtype, const float* bias, int64_t width,
                            GroupRows group_rows) override {
    return cpu::AddGroupBias(y, dtype, bias, width, group_rows, threads_);
  }
  absl::Status GroupBiasGrad(const void* d_y, DType dtype, int64_t width, GroupRows group_rows,
                             float* d_bias) override {
    return cpu::GroupBiasGrad(d_y, dtype, width, group_rows, d_bias, threads_);
  }
  absl::Status OptimizerStep(const OptimizerArgs& args, float* param, const float* grad,
                             float* state1, float* state2, int64_t count) override {
    return cpu::OptimizerStep(args, param, grad, state1, state2, count, threads_);
  }
  absl::Status AllFinite(const float* data, int64_t count, bool* all_finite) override {
    std::atomic<bool> finite{true};
    cpu::ParallelFor(threads_, count, /*grain=*/int64_t{1} << 18, [&](int64_t begin, int64_t end) {
      bool bad = false;  // no early exit: the loop vectorises
      for (int64_t i = begin; i < end; ++i) bad |= !(std::fabs(data[i]) <= FLT_MAX);
      if (bad) finite.store(false, std::memory_order_relaxed);
    });
    *all_finite = finite.load();
    return absl::OkStatus();
  }

 private:
  const int threads_;
  std::atomic<size_t> allocated_{0};
  std::atomic<size_t> peak_{0};
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace moe
