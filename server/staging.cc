#include "server/staging.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/layer_info.h"
#include "proto/tensor_convert.h"

namespace moe {

namespace {

// Whether [offset, offset + rows) overlaps a range of `ranges` (offset -> rows, disjoint).
bool Overlaps(const std::map<int64_t, int64_t>& ranges, int64_t offset, int64_t rows) {
  auto next = ranges.lower_bound(offset);
  if (next != ranges.end() && next->first < offset + rows) return true;
  if (next == ranges.begin()) return false;
  auto before = std::prev(next);
  return before->first + before->second > offset;
}

absl::Status CheckRows(int64_t row_offset, int64_t rows, int64_t total_rows) {
  if (row_offset < 0 || rows <= 0 || row_offset > total_rows - rows) {
    return absl::InvalidArgumentError(absl::StrCat("rows [", row_offset, ", ", row_offset, " + ",
                                                   rows, ") do not lie in [0, ", total_rows, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

void AppendSubSlices(const std::vector<grpc::Slice>& slices, size_t offset, size_t length,
                     std::vector<grpc::Slice>* out) {
  for (const grpc::Slice& slice : slices) {
    if (length == 0) return;
    if (offset >= slice.size()) {
      offset -= slice.size();
      continue;
    }
    const size_t take = std::min(length, slice.size() - offset);
    out->push_back(slice.sub(offset, offset + take));
    length -= take;
    offset = 0;
  }
}

StagingTable::StagingTable(RelayPool* pool, int64_t max_bytes, absl::Duration ttl)
    : pool_(pool), max_bytes_(max_bytes), ttl_(ttl) {}

absl::Status StagingTable::Admit(int64_t bytes) {
  if (bytes > max_bytes_ - bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("staged tensors would hold ", bytes_ + bytes, " bytes, more than moed's ",
                     "--shm_relay_max_bytes (", max_bytes_, "); send the tensor in the step"));
  }
  return absl::OkStatus();
}

void StagingTable::EraseLocked(std::map<Key, Entry>::iterator it) {
  bytes_ -= it->second.bytes;
  entries_.erase(it);
}

absl::StatusOr<std::shared_ptr<RelayBuffer>> StagingTable::ReservePart(const Key& key,
                                                                       int64_t total_rows,
                                                                       int64_t row_offset,
                                                                       int64_t rows, DType dtype,
                                                                       int64_t hidden) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    const int64_t row_bytes = hidden * static_cast<int64_t>(DTypeSize(dtype));
    if (total_rows > std::numeric_limits<int64_t>::max() / row_bytes) {
      return absl::InvalidArgumentError("total_rows * row size: overflows int64");
    }
    Entry entry;
    entry.dtype = dtype;
    entry.rows = total_rows;
    entry.hidden = hidden;
    entry.bytes = total_rows * row_bytes;
    RETURN_IF_ERROR(Admit(entry.bytes));
    entry.buffer = pool_->Take(entry.bytes);
    if (entry.buffer == nullptr) {
      return absl::ResourceExhaustedError(
          "moed's relay buffers are full (--shm_relay_max_bytes) or /dev/shm refused one; "
          "send the tensor in the step");
    }
    bytes_ += entry.bytes;
    it = entries_.emplace(key, std::move(entry)).first;
  }
  Entry& e = it->second;
  if (e.output) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: \"", key.second, "\" is a staged output; fetch it or pick another"));
  }
  if (e.rows != total_rows || e.dtype != dtype || e.hidden != hidden) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows: [", total_rows, ", ", hidden, "] ", DTypeName(dtype), " differs from the earlier ",
        "parts of \"", key.second, "\": [", e.rows, ", ", e.hidden, "] ", DTypeName(e.dtype)));
  }
  if (Overlaps(e.parts, row_offset, rows)) {
    return absl::InvalidArgumentError(absl::StrCat("row_offset: rows [", row_offset, ", ",
                                                   row_offset + rows, ") were already sent"));
  }
  e.parts.emplace(row_offset, rows);
  e.last_used = absl::Now();
  return e.buffer;
}

absl::Status StagingTable::Stage(const std::string& owner, const std::string& name,
                                 int64_t total_rows, int64_t row_offset, const v1::Tensor& head,
                                 const TensorBytes& bytes) {
  if (pool_ == nullptr) {
    return absl::UnimplementedError("staged tensors are off (moed --shm_relay=false)");
  }
  RETURN_IF_ERROR(ValidateLayerName("name", name));
  ASSIGN_OR_RETURN(DType dtype, CheckTensorHead("rows", head, bytes.size()));
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows.datatype: ", head.datatype(), " is not FP32 or BF16"));
  }
  if (head.shape_size() != 2 || head.shape(0) <= 0 || head.shape(1) <= 0) {
    return absl::InvalidArgumentError("rows.shape: expected [rows >= 1, hidden >= 1]");
  }
  if (total_rows <= 0) return absl::InvalidArgumentError("total_rows: must be >= 1");
  const int64_t rows = head.shape(0), hidden = head.shape(1);
  RETURN_IF_ERROR(CheckRows(row_offset, rows, total_rows));
  const Key key(owner, name);
  ASSIGN_OR_RETURN(std::shared_ptr<RelayBuffer> buffer,
                   ReservePart(key, total_rows, row_offset, rows, dtype, hidden));
  // Parts of one tensor copy concurrently, each into its own rows.
  bytes.CopyTo(buffer->data + row_offset * hidden * static_cast<int64_t>(DTypeSize(dtype)));
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second.buffer == buffer) it->second.rows_written += rows;
  return absl::OkStatus();
}

absl::StatusOr<StagedInput> StagingTable::TakeInput(const std::string& owner,
                                                    const std::string& name, int64_t hidden) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(Key(owner, name));
  if (it == entries_.end() || it->second.output) {
    return absl::NotFoundError(absl::StrCat("no staged input \"", name, "\" of this caller ",
                                            "(StageTensor; unused ones expire)"));
  }
  Entry e = std::move(it->second);
  EraseLocked(it);
  if (e.rows_written != e.rows) {
    return absl::FailedPreconditionError(absl::StrCat("staged tensor \"", name, "\" has ",
                                                      e.rows_written, " of its ", e.rows,
                                                      " rows; it was dropped"));
  }
  if (e.hidden != hidden) {
    return absl::InvalidArgumentError(absl::StrCat("staged tensor \"", name, "\": hidden ",
                                                   e.hidden, " != the layer's ", hidden));
  }
  return StagedInput{std::move(e.buffer), e.dtype, e.rows, e.hidden};
}

absl::Status StagingTable::CheckOutputName(const std::string& owner, const std::string& name) {
  if (pool_ == nullptr) {
    return absl::UnimplementedError("staged tensors are off (moed --shm_relay=false)");
  }
  RETURN_IF_ERROR(ValidateLayerName("out_staged", name));
  absl::MutexLock lock(&mu_);
  if (entries_.count(Key(owner, name)) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("a staged tensor \"", name, "\" exists"));
  }
  return absl::OkStatus();
}

absl::Status StagingTable::PutOutput(const std::string& owner, const std::string& name, DType dtype,
                                     int64_t rows, int64_t hidden,
                                     std::vector<grpc::Slice> slices) {
  Entry e;
  e.output = true;
  e.dtype = dtype;
  e.rows = rows;
  e.hidden = hidden;
  e.bytes = rows * hidden * static_cast<int64_t>(DTypeSize(dtype));
  e.slices = std::move(slices);
  e.last_used = absl::Now();
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(Admit(e.bytes));
  auto [it, added] = entries_.emplace(Key(owner, name), std::move(e));
  if (!added) {
    return absl::AlreadyExistsError(absl::StrCat("a staged tensor \"", name, "\" exists"));
  }
  bytes_ += it->second.bytes;
  return absl::OkStatus();
}

absl::Status StagingTable::Fetch(const std::string& owner, const std::string& name,
                                 int64_t row_offset, int64_t rows, v1::Tensor* head,
                                 std::vector<grpc::Slice>* slices) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(Key(owner, name));
  if (it == entries_.end() || !it->second.output) {
    return absl::NotFoundError(absl::StrCat("no staged output \"", name, "\" of this caller ",
                                            "(fully fetched ones are freed; unused ones expire)"));
  }
  Entry& e = it->second;
  RETURN_IF_ERROR(CheckRows(row_offset, rows, e.rows));
  const size_t row_bytes = e.hidden * DTypeSize(e.dtype);
  AppendSubSlices(e.slices, row_offset * row_bytes, rows * row_bytes, slices);
  head->set_datatype(DTypeName(e.dtype));
  head->add_shape(rows);
  head->add_shape(e.hidden);
  // A range fetched again (a retry) is served but counted once.
  if (!Overlaps(e.fetched, row_offset, rows)) {
    e.fetched.emplace(row_offset, rows);
    e.rows_fetched += rows;
  }
  e.last_used = absl::Now();
  if (e.rows_fetched == e.rows) EraseLocked(it);  // the slices handed out keep their bytes
  return absl::OkStatus();
}

void StagingTable::DropExpired(absl::Time now) {
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (now - it->second.last_used > ttl_) EraseLocked(it);
    it = next;
  }
}

int64_t StagingTable::staged_bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

}  // namespace moe
