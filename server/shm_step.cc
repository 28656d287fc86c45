#include "server/shm_step.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, what));
}

// [offset, offset + byte_size) inside a region of region_bytes, offset aligned to `align`.
absl::Status CheckRange(absl::string_view field, int64_t offset, int64_t byte_size,
                        int64_t region_bytes, int64_t align) {
  if (offset < 0) return Invalid(field, absl::StrCat(".offset: ", offset, " < 0"));
  if (byte_size < 0) return Invalid(field, absl::StrCat(".byte_size: ", byte_size, " < 0"));
  if (offset % align != 0) {
    return Invalid(field, absl::StrCat(".offset: ", offset,
                                       " is not a multiple of the element "
                                       "size ",
                                       align));
  }
  if (offset > region_bytes || byte_size > region_bytes - offset) {
    return Invalid(field, absl::StrCat(": bytes [", offset, ", ", offset, " + ", byte_size,
                                       ") are outside the region (", region_bytes, " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ShmStep::SetInput(absl::string_view field, const v1::SharedMemoryTensor& tensor,
                               int64_t hidden, ShmLease lease) {
  absl::StatusOr<DType> dtype = ParseDType(tensor.datatype());
  if (!dtype.ok() || (*dtype != DType::kFloat32 && *dtype != DType::kBFloat16)) {
    return Invalid(field,
                   absl::StrCat(".datatype: \"", tensor.datatype(), "\" is not FP32 or BF16"));
  }
  if (tensor.shape_size() != 2) {
    return Invalid(field, absl::StrCat(".shape: rank ", tensor.shape_size(), ", expected [tokens, ",
                                       hidden, "]"));
  }
  if (tensor.shape(1) != hidden) {
    return Invalid(field, absl::StrCat(".shape[1]: ", tensor.shape(1),
                                       " != the layer's hidden size ", hidden));
  }
  const int64_t element = static_cast<int64_t>(DTypeSize(*dtype));
  const int64_t tokens = tensor.shape(0);
  // hidden <= 65536 and element <= 4: the row size cannot overflow; tokens can.
  const int64_t row_bytes = hidden * element;
  if (tokens < 0 || (row_bytes > 0 && tokens > INT64_MAX / row_bytes)) {
    return Invalid(field, absl::StrCat(".shape[0]: ", tokens, " is negative or too large"));
  }
  if (tensor.byte_size() != tokens * row_bytes) {
    return Invalid(field,
                   absl::StrCat(".byte_size: ", tensor.byte_size(), " != ", tokens * row_bytes,
                                " (shape x ", element, "-byte ", tensor.datatype(), ")"));
  }
  absl::Status range =
      CheckRange(field, tensor.offset(), tensor.byte_size(), lease->byte_size, element);
  if (!range.ok()) return range;
  input_ = std::move(lease);
  datatype_ = tensor.datatype();
  dtype_ = *dtype;
  tokens_ = tokens;
  hidden_ = hidden;
  input_offset_ = tensor.offset();
  input_bytes_ = tensor.byte_size();
  return absl::OkStatus();
}

absl::Status ShmStep::SetOutput(absl::string_view field, const v1::SharedMemoryOutput& output,
                                ShmLease lease) {
  // Alignment is checked by CheckOutput (it depends on the output's datatype).
  absl::Status range = CheckRange(field, output.offset(), output.byte_size(), lease->byte_size, 1);
  if (!range.ok()) return range;
  output_ = std::move(lease);
  output_field_ = std::string(field);
  output_offset_ = output.offset();
  output_capacity_ = output.byte_size();
  return absl::OkStatus();
}

absl::Status ShmStep::CheckOutput(int64_t tokens, int64_t hidden, DType dtype) {
  if (!output_) return absl::OkStatus();
  const int64_t element = static_cast<int64_t>(DTypeSize(dtype));
  output_row_bytes_ = hidden * element;
  output_dtype_ = dtype;
  if (output_offset_ % element != 0) {
    return Invalid(output_field_, absl::StrCat(".offset: ", output_offset_,
                                               " is not a multiple of the element size ", element));
  }
  if (output_row_bytes_ > 0 && tokens > output_capacity_ / output_row_bytes_) {
    return Invalid(output_field_, absl::StrCat(".byte_size: ", output_capacity_, " < the output's ",
                                               tokens, " x ", output_row_bytes_, " bytes"));
  }
  const int64_t bytes = tokens * output_row_bytes_;
  if (input_ && input_->id == output_->id && output_offset_ < input_offset_ + input_bytes_ &&
      input_offset_ < output_offset_ + bytes) {
    return Invalid(output_field_,
                   ": the output's bytes overlap the input's in region \"" + output_->name + "\"");
  }
  return absl::OkStatus();
}

void ShmStep::Fill(const ShmRegion& region, int64_t offset, int64_t byte_size,
                   internal::WorkerShmSlice* slice) {
  slice->set_region_id(region.id);
  slice->set_key(region.key);
  slice->set_region_offset(region.offset);
  slice->set_region_byte_size(region.byte_size);
  slice->set_device(region.device);
  slice->set_inode(region.inode);
  slice->set_cuda_handle(region.cuda_handle);
  slice->set_offset(offset);
  slice->set_byte_size(byte_size);
}

void ShmStep::SliceInput(int64_t row_begin, int64_t row_end, v1::Tensor* meta,
                         internal::WorkerShmSlice* slice) const {
  const int64_t row_bytes = hidden_ * static_cast<int64_t>(DTypeSize(dtype_));
  meta->set_datatype(datatype_);
  meta->add_shape(row_end - row_begin);
  meta->add_shape(hidden_);
  Fill(*input_, input_offset_ + row_begin * row_bytes, (row_end - row_begin) * row_bytes, slice);
}

void ShmStep::SliceOutput(int64_t row_begin, int64_t row_end,
                          internal::WorkerShmSlice* slice) const {
  Fill(*output_, output_offset_ + row_begin * output_row_bytes_,
       (row_end - row_begin) * output_row_bytes_, slice);
  slice->set_datatype(DTypeName(output_dtype_));
}

}  // namespace moe
