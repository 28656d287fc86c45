#include "client/tensor_proto.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {
namespace client {

void TensorToProto(const Tensor& tensor, v1::Tensor* out) {
  out->set_datatype(DTypeName(tensor.dtype()));
  out->clear_shape();
  for (int64_t d : tensor.shape()) out->add_shape(d);
  out->set_raw_data(tensor.bytes().data(), tensor.bytes().size());
}

v1::Tensor TensorToProto(const Tensor& tensor) {
  v1::Tensor out;
  TensorToProto(tensor, &out);
  return out;
}

absl::StatusOr<Tensor> TensorFromProto(const v1::Tensor& proto, absl::string_view field) {
  absl::StatusOr<DType> dtype = ParseDType(proto.datatype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".datatype: unknown datatype '", proto.datatype(), "'"));
  }
  std::vector<int64_t> shape(proto.shape().begin(), proto.shape().end());
  RETURN_IF_ERROR(CheckByteCount(field, *dtype, shape, proto.raw_data().size()));
  return Tensor::FromBytes(*dtype, std::move(shape), proto.raw_data());
}

std::vector<v1::TensorChunk> ChunkTensor(const std::string& name, const Tensor& tensor,
                                         int64_t max_chunk_bytes) {
  const int64_t element_size = static_cast<int64_t>(DTypeSize(tensor.dtype()));
  const int64_t per_chunk = std::max<int64_t>(1, max_chunk_bytes / element_size);
  const int64_t total = tensor.num_elements();
  std::vector<v1::TensorChunk> chunks;
  int64_t offset = 0;
  do {
    const int64_t count = std::min(per_chunk, total - offset);
    v1::TensorChunk& chunk = chunks.emplace_back();
    chunk.set_name(name);
    chunk.set_datatype(DTypeName(tensor.dtype()));
    for (int64_t d : tensor.shape()) chunk.add_shape(d);
    chunk.set_element_offset(offset);
    chunk.set_raw_data(tensor.bytes().data() + offset * element_size,
                       static_cast<size_t>(count * element_size));
    offset += count;
  } while (offset < total);
  return chunks;
}

absl::Status ChunkAssembler::CloseCurrent() {
  if (!open_) return absl::OkStatus();
  if (filled_elements_ != current_.tensor.num_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", current_.name, "' is incomplete: ", filled_elements_, " of ",
                     current_.tensor.num_elements(), " elements received"));
  }
  done_.push_back(std::move(current_));
  current_ = NamedTensor();
  open_ = false;
  filled_elements_ = 0;
  return absl::OkStatus();
}

absl::Status ChunkAssembler::Add(const v1::TensorChunk& chunk) {
  const std::string field = absl::StrCat("chunk of '", chunk.name(), "'");
  absl::StatusOr<DType> parsed = ParseDType(chunk.datatype());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": unknown datatype '", chunk.datatype(), "'"));
  }
  const DType dtype = *parsed;
  std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
  // A tensor's chunks are consecutive: a new name, or a completed tensor, starts a new one.
  const bool continues =
      open_ && chunk.name() == current_.name && filled_elements_ < current_.tensor.num_elements();
  if (!continues) {
    RETURN_IF_ERROR(CloseCurrent());
    for (const NamedTensor& seen : done_) {
      if (seen.name == chunk.name()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", chunk.name(), "' appears twice in the stream"));
      }
    }
    // The whole tensor is allocated from the first chunk's shape: its size must not overflow.
    unsigned __int128 bytes = DTypeSize(dtype);
    for (int64_t d : shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat(field, ": negative dimension"));
      bytes *= static_cast<uint64_t>(d);
      if (bytes > (static_cast<unsigned __int128>(1) << 62)) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": shape is too large"));
      }
    }
    current_.name = chunk.name();
    current_.tensor = Tensor::Zeros(dtype, shape);
    open_ = true;
    filled_elements_ = 0;
  } else if (dtype != current_.tensor.dtype() || shape != current_.tensor.shape()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": datatype or shape differs from the tensor's first chunk"));
  }
  if (chunk.element_offset() != filled_elements_) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": element_offset ", chunk.element_offset(), ", expected ", filled_elements_));
  }
  const int64_t element_size = static_cast<int64_t>(DTypeSize(dtype));
  if (chunk.raw_data().size() % element_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": raw_data is not a whole number of elements"));
  }
  const int64_t count = static_cast<int64_t>(chunk.raw_data().size()) / element_size;
  if (filled_elements_ + count > current_.tensor.num_elements()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": chunks overrun the tensor"));
  }
  std::memcpy(current_.tensor.data<uint8_t>() + filled_elements_ * element_size,
              chunk.raw_data().data(), chunk.raw_data().size());
  filled_elements_ += count;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedTensor>> ChunkAssembler::Finish() {
  RETURN_IF_ERROR(CloseCurrent());
  return std::move(done_);
}

}  // namespace client
}  // namespace moe
