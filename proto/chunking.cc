#include "proto/chunking.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"
#include "proto/tensor_convert.h"

namespace moe {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// A shape a peer announced is allocated whole: no negative dimension, and at most 2^62 bytes
// (multiplied without wrapping, so a hostile shape cannot pass as a small one).
absl::Status CheckAllocatable(absl::string_view field, DType dtype,
                              const std::vector<int64_t>& shape) {
  unsigned __int128 bytes = DTypeSize(dtype);
  for (int64_t d : shape) {
    if (d < 0) return Invalid(field, "negative dimension");
    bytes *= static_cast<uint64_t>(d);
    if (bytes > (static_cast<unsigned __int128>(1) << 62)) return Invalid(field, "too large");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ChunkTensor(const std::string& name, const Tensor& tensor, int64_t max_chunk_bytes,
                         const std::function<absl::Status(v1::TensorChunk&&)>& emit) {
  const int64_t elem = static_cast<int64_t>(DTypeSize(tensor.dtype()));
  if (max_chunk_bytes <= 0) max_chunk_bytes = kDefaultChunkBytes;
  const int64_t per_chunk = std::max<int64_t>(1, max_chunk_bytes / elem);
  const int64_t total = tensor.num_elements();
  int64_t offset = 0;
  do {
    const int64_t n = std::min(per_chunk, total - offset);
    v1::TensorChunk chunk;
    chunk.set_name(name);
    chunk.set_datatype(DTypeName(tensor.dtype()));
    for (int64_t d : tensor.shape()) chunk.add_shape(d);
    chunk.set_element_offset(offset);
    chunk.set_raw_data(tensor.bytes().data() + offset * elem, static_cast<size_t>(n * elem));
    RETURN_IF_ERROR(emit(std::move(chunk)));
    offset += n;
  } while (offset < total);
  return absl::OkStatus();
}

ChunkAssembler::ChunkAssembler(std::map<std::string, ExpectedTensor> expected)
    : expected_(std::move(expected)) {}

absl::StatusOr<ExpectedTensor> ChunkAssembler::ExpectFirstChunk(
    const std::string& field, const v1::TensorChunk& chunk) const {
  if (expected_.has_value()) {
    auto it = expected_->find(chunk.name());
    if (it == expected_->end()) {
      std::vector<std::string> names;
      for (const auto& kv : *expected_) names.push_back(kv.first);
      return Invalid(field, absl::StrCat("unknown tensor name (expected one of ",
                                         absl::StrJoin(names, ", "), ")"));
    }
    return it->second;
  }
  ExpectedTensor first;
  ASSIGN_OR_RETURN(first.dtype, DTypeFromProto(absl::StrCat(field, ".datatype"), chunk.datatype()));
  first.shape.assign(chunk.shape().begin(), chunk.shape().end());
  RETURN_IF_ERROR(CheckAllocatable(absl::StrCat(field, ".shape"), first.dtype, first.shape));
  return first;
}

absl::Status ChunkAssembler::Add(const v1::TensorChunk& chunk) {
  const std::string field = absl::StrCat("chunk \"", chunk.name(), "\"");
  auto found = std::find_if(tensors_.begin(), tensors_.end(),
                            [&](const Pending& p) { return p.named.name == chunk.name(); });
  Pending* pending = found == tensors_.end() ? nullptr : &*found;
  ExpectedTensor want;
  if (pending == nullptr) {
    ASSIGN_OR_RETURN(want, ExpectFirstChunk(field, chunk));
  } else {
    const Tensor& tensor = pending->named.tensor;
    if (pending->chunks > 0 && pending->filled == tensor.num_elements()) {
      return Invalid(field, "tensor already complete");
    }
    want = ExpectedTensor{tensor.dtype(), tensor.shape()};
  }
  if (chunk.datatype() != DTypeName(want.dtype)) {
    return Invalid(absl::StrCat(field, ".datatype"),
                   absl::StrCat("\"", chunk.datatype(), "\", expected ", DTypeName(want.dtype)));
  }
  std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
  RETURN_IF_ERROR(CheckShape(absl::StrCat(field, ".shape"), shape, want.shape));
  if (pending == nullptr) {
    tensors_.push_back({{chunk.name(), Tensor::Zeros(want.dtype, std::move(want.shape))}});
    pending = &tensors_.back();
  }

  const int64_t elem = static_cast<int64_t>(DTypeSize(pending->named.tensor.dtype()));
  const int64_t total = pending->named.tensor.num_elements();
  if (chunk.element_offset() != pending->filled) {
    return Invalid(absl::StrCat(field, ".element_offset"),
                   absl::StrCat(chunk.element_offset(), ", expected ", pending->filled,
                                " (chunks must be contiguous and in order)"));
  }
  const int64_t bytes = static_cast<int64_t>(chunk.raw_data().size());
  if (bytes % elem != 0) {
    return Invalid(absl::StrCat(field, ".raw_data"),
                   absl::StrCat(bytes, " bytes is not a whole number of ", elem, "-byte elements"));
  }
  const int64_t n = bytes / elem;
  if (pending->filled + n > total) {
    return Invalid(
        absl::StrCat(field, ".raw_data"),
        absl::StrCat("runs past the end (", pending->filled + n, " > ", total, " elements)"));
  }
  if (n > 0) {
    std::memcpy(static_cast<char*>(pending->named.tensor.raw()) + pending->filled * elem,
                chunk.raw_data().data(), chunk.raw_data().size());
  }
  pending->filled += n;
  pending->chunks += 1;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedTensor>> ChunkAssembler::Finish() {
  std::vector<NamedTensor> out;
  for (Pending& p : tensors_) {
    const int64_t total = p.named.tensor.num_elements();
    if (p.filled != total) {
      return Invalid(absl::StrCat("chunk \"", p.named.name, "\""),
                     absl::StrCat("incomplete (", p.filled, " of ", total, " elements)"));
    }
    out.push_back(std::move(p.named));
  }
  tensors_.clear();
  return out;
}

}  // namespace moe
