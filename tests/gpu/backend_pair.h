// Test helpers that run one Backend operation on the CPU backend (the reference) and on the
// CUDA backend with identical inputs, and compare what comes back. GPU tests only.
//
//   BackendPair bp;  // skips the test when no GPU is visible
//   auto x = bp.Upload(host_values);            // the same values on both backends
//   ASSERT_OK(bp.cpu()->Convert(x.cpu.data(), ...)); ASSERT_OK(bp.gpu()->Convert(x.gpu.data(),
//   ...)); EXPECT_LE(MaxRelError(bp.Download<float>(out, n)), 1e-6);
#ifndef MOED_TESTS_GPU_BACKEND_PAIR_H_
#define MOED_TESTS_GPU_BACKEND_PAIR_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/backend.h"
#include "engine/cuda/cuda_backend_options.h"
#include "engine/dtype.h"

namespace moe {
namespace gpu_test {

// The same tensor on both backends.
struct Mirrored {
  Buffer cpu, gpu;
};

// Both backends' copies of a result.
template <typename T>
struct Results {
  std::vector<T> cpu, gpu;
};

// max |a - b| / max(max |b|, tiny): the relative error of a against the reference b.
inline double MaxRelError(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double max_diff = 0, max_ref = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(b[i])));
  }
  return max_diff / max_ref;
}
template <typename T>
double MaxRelError(const Results<T>& r) {
  return MaxRelError(r.gpu, r.cpu);
}

inline std::vector<float> Bf16ToFloats(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Bf16ToFloat(v[i]);
  return out;
}
inline std::vector<uint16_t> FloatsToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
}

inline std::vector<float> RandomFloats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class BackendPair {
 public:
  // Fails (ok() false) when either backend cannot be made; the message says why.
  explicit BackendPair(const CudaBackendOptions& cuda_options = {});
  bool ok() const { return cpu_ != nullptr && gpu_ != nullptr; }
  const std::string& error() const { return error_; }
  Backend* cpu() const { return cpu_.get(); }
  Backend* gpu() const { return gpu_.get(); }

  // Allocates `bytes` on both and fills both with the same bytes (host memory `data`), or with
  // 0xAB poison when data is null (outputs must then be written by the kernel).
  Mirrored Upload(const void* data, size_t bytes);
  template <typename T>
  Mirrored Upload(const std::vector<T>& v) {
    return Upload(v.data(), v.size() * sizeof(T));
  }
  Mirrored Output(size_t bytes) { return Upload(nullptr, bytes); }

  template <typename T>
  Results<T> Download(const Mirrored& m, size_t count) {
    Results<T> r;
    r.cpu.resize(count);
    r.gpu.resize(count);
    Fetch(m, r.cpu.data(), r.gpu.data(), count * sizeof(T));
    return r;
  }
  // bf16 storage read back as floats.
  Results<float> DownloadBf16(const Mirrored& m, size_t count);

 private:
  void Fetch(const Mirrored& m, void* cpu_out, void* gpu_out, size_t bytes);
  std::unique_ptr<Backend> cpu_, gpu_;
  std::string error_;
};

}  // namespace gpu_test
}  // namespace moe

#endif  // MOED_TESTS_GPU_BACKEND_PAIR_H_
