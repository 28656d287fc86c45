#include "server/chunking.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe {

absl::Status ChunkTensor(const std::string& name, const Tensor& tensor, int64_t max_chunk_bytes,
                         const std::function<absl::Status(const v1::TensorChunk&)>& emit) {
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
    chunk.set_raw_data(tensor.bytes().data() + offset * elem, n * elem);
    absl::Status s = emit(chunk);
    if (!s.ok()) return s;
    offset += n;
  } while (offset < total);
  return absl::OkStatus();
}

absl::Status ChunkAssembler::Add(const v1::TensorChunk& chunk) {
  const std::string field = absl::StrCat("chunk \"", chunk.name(), "\"");
  auto it = expected_.find(chunk.name());
  if (it == expected_.end()) {
    std::vector<std::string> names;
    for (const auto& kv : expected_) names.push_back(kv.first);
    return absl::InvalidArgumentError(absl::StrCat(field, ": unknown tensor name (expected one of ",
                                                   absl::StrJoin(names, ", "), ")"));
  }
  const ExpectedTensor& want = it->second;
  if (chunk.datatype() != DTypeName(want.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".datatype: \"", chunk.datatype(),
                                                   "\", expected ", DTypeName(want.dtype)));
  }
  std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
  absl::Status shape_ok = CheckShape(absl::StrCat(field, ".shape"), shape, want.shape);
  if (!shape_ok.ok()) return shape_ok;

  Pending* pending = nullptr;
  for (Pending& p : tensors_) {
    if (p.name == chunk.name()) pending = &p;
  }
  if (pending == nullptr) {
    tensors_.push_back({chunk.name(), Tensor::Zeros(want.dtype, want.shape), 0, 0});
    pending = &tensors_.back();
  }
  const int64_t elem = static_cast<int64_t>(DTypeSize(want.dtype));
  const int64_t total = pending->tensor.num_elements();
  if (pending->chunks > 0 && pending->filled == total) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": tensor already complete"));
  }
  if (chunk.element_offset() != pending->filled) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".element_offset: ", chunk.element_offset(), ", expected ",
                     pending->filled, " (chunks must be contiguous and in order)"));
  }
  if (static_cast<int64_t>(chunk.raw_data().size()) % elem != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".raw_data: ", chunk.raw_data().size(),
                                                   " bytes is not a whole number of ", elem,
                                                   "-byte elements"));
  }
  const int64_t n = static_cast<int64_t>(chunk.raw_data().size()) / elem;
  if (pending->filled + n > total) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".raw_data: runs past the end (", pending->filled + n, " > ", total, " elements)"));
  }
  std::memcpy(static_cast<char*>(pending->tensor.raw()) + pending->filled * elem,
              chunk.raw_data().data(), chunk.raw_data().size());
  pending->filled += n;
  pending->chunks += 1;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> ChunkAssembler::Finish() {
  std::vector<std::pair<std::string, Tensor>> out;
  for (Pending& p : tensors_) {
    if (p.filled != p.tensor.num_elements()) {
      return absl::InvalidArgumentError(absl::StrCat("chunk \"", p.name, "\": incomplete (",
                                                     p.filled, " of ", p.tensor.num_elements(),
                                                     " elements)"));
    }
    out.emplace_back(p.name, std::move(p.tensor));
  }
  tensors_.clear();
  return out;
}

}  // namespace moe
