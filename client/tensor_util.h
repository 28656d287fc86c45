// Host-tensor helpers for clients: bf16 conversion, deterministic random inputs and the
// error metrics moectl's smoke test reports.
//
//   moe::Tensor x = moe::client::RandomNormal(moe::DType::kFloat32, {32, 1024}, /*seed=*/7);
//   moe::Tensor x_bf16 = moe::client::ToBf16(x);          // round to nearest even
//   double err = moe::client::MaxRelError(remote, local);  // max|a-b| / max|b|
#ifndef MOED_CLIENT_TENSOR_UTIL_H_
#define MOED_CLIENT_TENSOR_UTIL_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tensor.h"

namespace moe {
namespace client {

// FP32/FP64/BF16 -> BF16 (round to nearest even) and -> FP32 (exact from BF16).
Tensor ToBf16(const Tensor& tensor);
Tensor ToFp32(const Tensor& tensor);

// Elements of a FP32/BF16/FP64 tensor as floats (INT32/INT64 are converted by value).
std::vector<float> ToFloatVector(const Tensor& tensor);

// A tensor of `dtype` (FP32 or BF16) with elements drawn from N(0, stddev^2) by a generator
// seeded with `seed` (std::mt19937_64: the same values on every run and machine).
Tensor RandomNormal(DType dtype, const std::vector<int64_t>& shape, uint64_t seed,
                    double stddev = 1.0);

// max_i |a_i - b_i| / max(max_i |b_i|, 1e-30): the error of `a` relative to the scale of the
// reference `b` (robust to elements of b near zero). Shapes must match (INVALID_ARGUMENT).
// NaN anywhere gives +inf.
absl::StatusOr<double> MaxRelError(const Tensor& a, const Tensor& b);
// |a - b| / max(|b|, 1e-30) for scalars (losses); 0 when both are 0.
double ScalarRelError(double a, double b);

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_TENSOR_UTIL_H_
