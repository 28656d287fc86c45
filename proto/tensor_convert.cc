#include "proto/tensor_convert.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {

absl::StatusOr<DType> DTypeFromProto(absl::string_view field, absl::string_view datatype) {
  if (datatype.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  absl::StatusOr<DType> dtype = ParseDType(datatype);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": unknown datatype \"", datatype,
                                                   "\" (FP32, BF16, FP64, INT32, INT64)"));
  }
  return *dtype;
}

absl::StatusOr<DType> CheckTensorProto(absl::string_view field, const v1::Tensor& proto) {
  return CheckTensorHead(field, proto, proto.raw_data().size());
}

absl::StatusOr<DType> CheckTensorHead(absl::string_view field, const v1::Tensor& proto,
                                      size_t byte_count) {
  ASSIGN_OR_RETURN(DType dtype, DTypeFromProto(absl::StrCat(field, ".datatype"), proto.datatype()));
  std::vector<int64_t> shape(proto.shape().begin(), proto.shape().end());
  RETURN_IF_ERROR(CheckByteCount(field, dtype, shape, byte_count));
  return dtype;
}

absl::StatusOr<Tensor> TensorFromProto(absl::string_view field, const v1::Tensor& proto) {
  ASSIGN_OR_RETURN(DType dtype, CheckTensorProto(field, proto));
  std::vector<int64_t> shape(proto.shape().begin(), proto.shape().end());
  return Tensor::FromBytes(dtype, std::move(shape), proto.raw_data());
}

void SetTensorMeta(const Tensor& tensor, v1::Tensor* proto) {
  proto->set_datatype(DTypeName(tensor.dtype()));
  proto->clear_shape();
  for (int64_t d : tensor.shape()) proto->add_shape(d);
  proto->clear_raw_data();
}

void TensorToProto(const Tensor& tensor, v1::Tensor* proto) {
  SetTensorMeta(tensor, proto);
  proto->set_raw_data(tensor.bytes().data(), tensor.bytes().size());
}

}  // namespace moe
