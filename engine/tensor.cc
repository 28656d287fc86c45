#include "engine/tensor.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe {

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor Tensor::Zeros(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.bytes_.assign(static_cast<size_t>(NumElements(t.shape_)) * DTypeSize(dtype), 0);
  return t;
}

Tensor Tensor::Uninitialized(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.bytes_.resize(static_cast<size_t>(NumElements(t.shape_)) * DTypeSize(dtype));
  return t;
}

absl::StatusOr<Tensor> Tensor::FromBytes(DType dtype, std::vector<int64_t> shape,
                                         absl::string_view bytes) {
  absl::Status status = CheckByteCount("tensor", dtype, shape, bytes.size());
  if (!status.ok()) return status;
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.bytes_.assign(bytes.begin(), bytes.end());
  return t;
}

Tensor Tensor::View(DType dtype, std::vector<int64_t> shape, void* data) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.view_bytes_ = static_cast<size_t>(NumElements(t.shape_)) * DTypeSize(dtype);
  // A view of nothing is an empty owning tensor: raw() of either is never dereferenced.
  if (t.view_bytes_ > 0) t.view_ = static_cast<uint8_t*>(data);
  if (t.view_ == nullptr) t.view_bytes_ = 0;
  return t;
}

Tensor Tensor::FromFloats(std::vector<int64_t> shape, const std::vector<float>& values) {
  Tensor t = Uninitialized(DType::kFloat32, std::move(shape));
  if (!t.bytes_.empty()) std::memcpy(t.bytes_.data(), values.data(), t.bytes_.size());
  return t;
}

int64_t Tensor::num_elements() const { return NumElements(shape_); }

float Tensor::GetFloat(int64_t i) const {
  switch (dtype_) {
    case DType::kFloat32:
      return data<float>()[i];
    case DType::kBFloat16:
      return Bf16ToFloat(data<uint16_t>()[i]);
    case DType::kFloat64:
      return static_cast<float>(data<double>()[i]);
    default:
      return std::numeric_limits<float>::quiet_NaN();
  }
}

Tensor Tensor::ConvertTo(DType dtype) const {
  if (dtype == dtype_) return *this;  // a view stays a view
  Tensor out = Zeros(dtype, shape_);
  const int64_t n = num_elements();
  for (int64_t i = 0; i < n; ++i) {
    const float v = GetFloat(i);
    switch (dtype) {
      case DType::kFloat32:
        out.data<float>()[i] = v;
        break;
      case DType::kBFloat16:
        out.data<uint16_t>()[i] = FloatToBf16(v);
        break;
      case DType::kFloat64:
        out.data<double>()[i] = dtype_ == DType::kFloat64 ? data<double>()[i] : v;
        break;
      default:
        break;
    }
  }
  return out;
}

Tensor Tensor::SliceRows(int64_t begin, int64_t end) const {
  std::vector<int64_t> shape = shape_;
  shape[0] = end - begin;
  Tensor out = Uninitialized(dtype_, shape);  // every byte copied below
  const size_t row_bytes = shape_[0] == 0 ? 0 : num_bytes() / shape_[0];
  if (!out.bytes_.empty()) {
    std::memcpy(out.bytes_.data(), static_cast<const uint8_t*>(raw()) + begin * row_bytes,
                out.bytes_.size());
  }
  return out;
}

std::string Tensor::ShapeString() const { return absl::StrCat("[", absl::StrJoin(shape_, ", "), "]"); }

absl::Status CheckShape(absl::string_view field, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& expected) {
  if (shape == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": shape [", absl::StrJoin(shape, ", "),
                                                 "] does not match the expected [",
                                                 absl::StrJoin(expected, ", "), "]"));
}

absl::Status CheckTensorFits(absl::string_view field, const Tensor& tensor, DType dtype,
                             const std::vector<int64_t>& shape) {
  if (tensor.dtype() == dtype && tensor.shape() == shape) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " is ", DTypeName(tensor.dtype()), " ", tensor.ShapeString(), "; the result is ",
      DTypeName(dtype), " [", absl::StrJoin(shape, ", "), "]"));
}

absl::Status CheckByteCount(absl::string_view field, DType dtype,
                            const std::vector<int64_t>& shape, size_t byte_count) {
  // Multiply with an overflow check: a hostile shape must not wrap around to a small size.
  unsigned __int128 expected = DTypeSize(dtype);
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": negative dimension ", d, " in shape [", absl::StrJoin(shape, ", "), "]"));
    }
    expected *= static_cast<uint64_t>(d);
    if (expected > (static_cast<unsigned __int128>(1) << 62)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape [", absl::StrJoin(shape, ", "), "] is too large"));
    }
  }
  if (expected != byte_count) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", byte_count, " bytes of raw data but shape [", absl::StrJoin(shape, ", "),
        "] of ", DTypeName(dtype), " needs ", static_cast<uint64_t>(expected)));
  }
  return absl::OkStatus();
}

}  // namespace moe
