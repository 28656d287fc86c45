// moe.v1.Tensor (wire) <-> moe::Tensor (engine host tensor), for the front end, the workers
// and the client alike. Datatypes travel by their engine/dtype.h names: "FP32", "BF16",
// "FP64", "INT32", "INT64". Every error is INVALID_ARGUMENT naming the field as the request
// (or response) spells it.
//
//   TensorToProto(x, request.mutable_x());
//   ASSIGN_OR_RETURN(Tensor x, TensorFromProto("x", request.x()));
#ifndef MOED_PROTO_TENSOR_CONVERT_H_
#define MOED_PROTO_TENSOR_CONVERT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/tensor.h"
#include "proto/moe.pb.h"

namespace moe {

// A wire datatype name -> DType; `field` is the datatype field ("x.datatype").
absl::StatusOr<DType> DTypeFromProto(absl::string_view field, absl::string_view datatype);

// Checks datatype, shape >= 0 and the raw byte count without copying the bytes.
absl::StatusOr<DType> CheckTensorProto(absl::string_view field, const v1::Tensor& proto);
// The same with `byte_count` raw bytes in place of proto.raw_data() (which is not read): for
// a tensor whose bytes were kept out of the message (proto/tensor_wire.h).
absl::StatusOr<DType> CheckTensorHead(absl::string_view field, const v1::Tensor& proto,
                                      size_t byte_count);
// CheckTensorProto, then copies the bytes.
absl::StatusOr<Tensor> TensorFromProto(absl::string_view field, const v1::Tensor& proto);
void TensorToProto(const Tensor& tensor, v1::Tensor* proto);
// Datatype and shape only (no raw_data): for a tensor whose bytes travel elsewhere (shared
// memory).
void SetTensorMeta(const Tensor& tensor, v1::Tensor* proto);

}  // namespace moe

#endif  // MOED_PROTO_TENSOR_CONVERT_H_
