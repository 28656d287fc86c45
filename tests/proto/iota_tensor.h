// Test helper: a tensor whose bytes follow a fixed pattern (byte i = i * 13 + 1), so a
// chunk or conversion that moves, drops or repeats a byte shows.
//
//   Tensor t = IotaTensor(DType::kFloat32, {4, 8});
#ifndef MOED_TESTS_PROTO_IOTA_TENSOR_H_
#define MOED_TESTS_PROTO_IOTA_TENSOR_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/tensor.h"

namespace moe {

inline Tensor IotaTensor(DType dtype, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  for (size_t i = 0; i < t.num_bytes(); ++i) {
    t.data<uint8_t>()[i] = static_cast<uint8_t>(i * 13 + 1);
  }
  return t;
}

}  // namespace moe

#endif  // MOED_TESTS_PROTO_IOTA_TENSOR_H_
