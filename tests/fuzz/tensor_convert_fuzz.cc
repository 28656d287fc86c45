// libFuzzer target: a moe.v1.Tensor from the wire (proto/tensor_convert.cc: CheckTensorProto,
// TensorFromProto), as every Forward / Backward / SetWeights request carries one.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "proto/tensor_convert.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moe::v1::Tensor proto;
  if (!proto.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<moe::DType> checked = moe::CheckTensorProto("x", proto);
  absl::StatusOr<moe::Tensor> tensor = moe::TensorFromProto("x", proto);
  if (checked.ok() != tensor.ok()) std::abort();  // one validation, two entry points
  if (tensor.ok()) {
    moe::v1::Tensor back;
    moe::TensorToProto(*tensor, &back);
    if (back.raw_data().size() != tensor->bytes().size()) std::abort();
  }
  return 0;
}
