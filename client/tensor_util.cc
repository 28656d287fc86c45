#include "client/tensor_util.h"

#include <cmath>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"

namespace moe {
namespace client {

Tensor ToBf16(const Tensor& tensor) { return tensor.ConvertTo(DType::kBFloat16); }
Tensor ToFp32(const Tensor& tensor) { return tensor.ConvertTo(DType::kFloat32); }

std::vector<float> ToFloatVector(const Tensor& tensor) {
  const int64_t n = tensor.num_elements();
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (tensor.dtype()) {
      case DType::kInt32:
        out[i] = static_cast<float>(tensor.data<int32_t>()[i]);
        break;
      case DType::kInt64:
        out[i] = static_cast<float>(tensor.data<int64_t>()[i]);
        break;
      default:
        out[i] = tensor.GetFloat(i);
    }
  }
  return out;
}

Tensor RandomNormal(DType dtype, const std::vector<int64_t>& shape, uint64_t seed, double stddev) {
  Tensor t = Tensor::Zeros(DType::kFloat32, shape);
  std::mt19937_64 generator(seed);
  // Box-Muller by hand: std::normal_distribution's algorithm differs between standard
  // libraries, and moectl's random inputs should be reproducible anywhere.
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  float* data = t.data<float>();
  const int64_t n = t.num_elements();
  for (int64_t i = 0; i < n; i += 2) {
    const double u1 = 1.0 - uniform(generator);  // (0, 1]
    const double u2 = uniform(generator);
    const double r = std::sqrt(-2.0 * std::log(u1)) * stddev;
    data[i] = static_cast<float>(r * std::cos(2.0 * M_PI * u2));
    if (i + 1 < n) data[i + 1] = static_cast<float>(r * std::sin(2.0 * M_PI * u2));
  }
  return dtype == DType::kFloat32 ? t : t.ConvertTo(dtype);
}

absl::StatusOr<double> MaxRelError(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape mismatch: ", a.ShapeString(), " vs ", b.ShapeString()));
  }
  const std::vector<float> x = ToFloatVector(a);
  const std::vector<float> y = ToFloatVector(b);
  double max_diff = 0.0;
  double max_ref = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(x[i]) - y[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(y[i])));
  }
  if (max_diff == 0.0) return 0.0;
  return max_diff / std::max(max_ref, 1e-30);
}

double ScalarRelError(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::infinity();
  if (a == b) return 0.0;
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
}

}  // namespace client
}  // namespace moe
