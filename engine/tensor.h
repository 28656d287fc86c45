// A host tensor: dtype, row-major shape and the bytes that own its elements.
//
//   Tensor x = Tensor::Zeros(DType::kFloat32, {tokens, hidden});
//   x.data<float>()[0] = 1.0f;
//   Tensor y = x.ConvertTo(DType::kBFloat16);
//
// Tensors here live in host memory; device memory belongs to a Backend (engine/backend.h).
//
// A view (Tensor::View) is a tensor over bytes it does not own, e.g. a client's shared-memory
// region or a pinned buffer: the caller keeps those bytes alive while the view (or any copy of
// it) is used. Copying a view copies the pointer, as copying an absl::string_view does;
// ConvertTo to another dtype and SliceRows always return tensors that own their bytes.
#ifndef MOED_ENGINE_TENSOR_H_
#define MOED_ENGINE_TENSOR_H_

#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/dtype.h"

namespace moe {

// std::allocator whose value-less construct() default-initialises: vector<uint8_t>::resize(n)
// then leaves the bytes as they are instead of zeroing them (Tensor::Uninitialized).
template <typename T>
class DefaultInitAllocator : public std::allocator<T> {
 public:
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor Zeros(DType dtype, std::vector<int64_t> shape);
  // Like Zeros without writing the bytes (their values are unspecified): for a tensor that is
  // overwritten whole right away, e.g. a download target. Saves the memset and its page faults.
  static Tensor Uninitialized(DType dtype, std::vector<int64_t> shape);
  // Copies `bytes`; fails when its size is not shape-product * DTypeSize(dtype).
  static absl::StatusOr<Tensor> FromBytes(DType dtype, std::vector<int64_t> shape,
                                          absl::string_view bytes);
  // A view of `data` (product(shape) * DTypeSize(dtype) bytes; not copied, not owned).
  static Tensor View(DType dtype, std::vector<int64_t> shape, void* data);
  static Tensor FromFloats(std::vector<int64_t> shape, const std::vector<float>& values);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t num_elements() const;
  size_t num_bytes() const { return view_ != nullptr ? view_bytes_ : bytes_.size(); }
  bool is_view() const { return view_ != nullptr; }

  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(raw());
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(raw());
  }
  void* raw() { return view_ != nullptr ? static_cast<void*>(view_) : bytes_.data(); }
  const void* raw() const {
    return view_ != nullptr ? static_cast<const void*>(view_) : bytes_.data();
  }
  absl::string_view bytes() const {
    return absl::string_view(static_cast<const char*>(raw()), num_bytes());
  }

  // Element i as float (FP32, BF16, FP64 only).
  float GetFloat(int64_t i) const;
  // Element-wise conversion between floating types (a copy when dtype is the same).
  Tensor ConvertTo(DType dtype) const;
  // Rows [begin, end) of the first dimension.
  Tensor SliceRows(int64_t begin, int64_t end) const;

  std::string ShapeString() const;  // "[32, 1024]"

 private:
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  std::vector<uint8_t, DefaultInitAllocator<uint8_t>> bytes_;  // empty for a view
  uint8_t* view_ = nullptr;  // a view's bytes (not owned), else null
  size_t view_bytes_ = 0;
};

// A tensor with the name a layer gives it ("gate", "wi", ...): checkpoint files, chunk streams.
struct NamedTensor {
  std::string name;
  Tensor tensor;
};

int64_t NumElements(const std::vector<int64_t>& shape);

// Checks used at every edge that accepts tensors. Messages name `field`.
absl::Status CheckShape(absl::string_view field, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& expected);
// Fails (INVALID_ARGUMENT) unless `tensor` has `dtype` and `shape`: a buffer a caller gives to
// receive a result of that datatype and shape (e.g. the client's CallOptions::output).
absl::Status CheckTensorFits(absl::string_view field, const Tensor& tensor, DType dtype,
                             const std::vector<int64_t>& shape);
// Fails unless shape is non-negative and byte_count == product(shape) * DTypeSize(dtype).
absl::Status CheckByteCount(absl::string_view field, DType dtype, const std::vector<int64_t>& shape,
                            size_t byte_count);

}  // namespace moe

#endif  // MOED_ENGINE_TENSOR_H_
