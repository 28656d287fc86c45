// Conversions between engine host tensors (moe::Tensor) and the wire messages of moe.v1:
// whole tensors (moe.v1.Tensor) and named tensors split into chunks (moe.v1.TensorChunk,
// used by GetWeights, SetWeights and GetGradients).
//
//   moe::v1::Tensor wire = moe::client::TensorToProto(x);
//   ASSIGN_OR_RETURN(moe::Tensor back, moe::client::TensorFromProto(wire, "x"));
//
//   ChunkAssembler assembler;                 // receiving a chunk stream
//   for (const auto& chunk : stream) RETURN_IF_ERROR(assembler.Add(chunk));
//   ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, assembler.Finish());
//
// Datatypes: "FP32", "BF16", "FP64", "INT32", "INT64" (engine/dtype.h names).
#ifndef MOED_CLIENT_TENSOR_PROTO_H_
#define MOED_CLIENT_TENSOR_PROTO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/tensor.h"
#include "proto/moe.pb.h"

namespace moe {
namespace client {

struct NamedTensor {
  std::string name;
  Tensor tensor;
};

v1::Tensor TensorToProto(const Tensor& tensor);
void TensorToProto(const Tensor& tensor, v1::Tensor* out);
// INVALID_ARGUMENT naming `field` for an unknown datatype, a negative dimension or a byte count
// that does not match the shape.
absl::StatusOr<Tensor> TensorFromProto(const v1::Tensor& proto, absl::string_view field = "tensor");

// Splits a tensor into chunks of at most max_chunk_bytes of raw data each (rounded down to
// whole elements, at least one element per chunk). A tensor without elements is one empty chunk.
std::vector<v1::TensorChunk> ChunkTensor(const std::string& name, const Tensor& tensor,
                                         int64_t max_chunk_bytes);

// Reassembles chunk streams: the chunks of one tensor must be consecutive, agree on datatype
// and shape, start at element 0 and each continue where the previous ended; Finish() fails on
// a tensor left incomplete. Errors are INVALID_ARGUMENT naming the tensor.
class ChunkAssembler {
 public:
  absl::Status Add(const v1::TensorChunk& chunk);
  absl::StatusOr<std::vector<NamedTensor>> Finish();

 private:
  absl::Status CloseCurrent();

  std::vector<NamedTensor> done_;
  bool open_ = false;  // a tensor is being filled
  NamedTensor current_;
  int64_t filled_elements_ = 0;
};

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_TENSOR_PROTO_H_
