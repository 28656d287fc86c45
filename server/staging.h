// Staged tensors (proto/moe.proto, "Staged tensors"): a step's x / d_out that a caller sent as
// row ranges over several connections (StageTensor) into one of moed's relay buffers
// (server/relay_pool.h), and a step's out / d_x kept for the caller to fetch in row ranges
// (FetchStaged). Keyed by (owner, name), owner being the caller's identity
// (MoeServiceImpl::ClientOf): one caller cannot name another's tensors.
//
//   StagingTable staging(&relay_pool, absl::Seconds(60));
//   RETURN_IF_ERROR(staging.Stage(owner, "t1", /*total_rows=*/T, /*row_offset=*/0, head, bytes));
//   ... the other parts, concurrently ...
//   ASSIGN_OR_RETURN(StagedInput x, staging.TakeInput(owner, "t1"));   // complete, removed
//   RETURN_IF_ERROR(staging.PutOutput(owner, "t1o", dtype, T, H, std::move(out_slices)));
//   RETURN_IF_ERROR(staging.Fetch(owner, "t1o", 0, T / 2, &head, &slices));
#ifndef MOED_SERVER_STAGING_H_
#define MOED_SERVER_STAGING_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/dtype.h"
#include "proto/moe.pb.h"
#include "proto/tensor_wire.h"
#include "server/relay_pool.h"

namespace moe {

// A complete staged input, taken out of the table by the step that names it.
struct StagedInput {
  std::shared_ptr<RelayBuffer> buffer;  // rows * hidden elements of dtype, from byte 0
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t bytes() const { return rows * hidden * static_cast<int64_t>(DTypeSize(dtype)); }
};

// A step's staged input as the step code uses it: the head its message would have had
// ([T, H], datatype) and a view of the staged bytes (which `tensor` keeps alive).
struct StagedStepInput {
  StagedInput tensor;
  v1::Tensor head;
  TensorBytes bytes;
};

// Appends to *out sub-slices (not copies) of the concatenation of `slices` covering bytes
// [offset, offset + length) (within their total size).
void AppendSubSlices(const std::vector<grpc::Slice>& slices, size_t offset, size_t length,
                     std::vector<grpc::Slice>* out);

class StagingTable {
 public:
  // Inputs take buffers from `pool` (null: staging is off, UNIMPLEMENTED); outputs hold the
  // step's answer slices. At most max_bytes are staged at once (RESOURCE_EXHAUSTED naming
  // --shm_relay_max_bytes); a tensor unused for ttl is dropped by DropExpired.
  StagingTable(RelayPool* pool, int64_t max_bytes, absl::Duration ttl);

  // StageTensor: copies the part's bytes into the tensor's buffer (made by the first part).
  absl::Status Stage(const std::string& owner, const std::string& name, int64_t total_rows,
                     int64_t row_offset, const v1::Tensor& head, const TensorBytes& bytes);
  // A complete input of hidden size `hidden` (INVALID_ARGUMENT otherwise), removed from the
  // table: NOT_FOUND when unknown, FAILED_PRECONDITION when rows are missing (also removed).
  absl::StatusOr<StagedInput> TakeInput(const std::string& owner, const std::string& name,
                                        int64_t hidden);
  // Checks that `name` is free for an output (ALREADY_EXISTS) and a valid name.
  absl::Status CheckOutputName(const std::string& owner, const std::string& name);
  // Keeps a step's output [rows, hidden] of dtype, whose bytes are `slices` (e.g. over a relay
  // buffer or the workers' answers).
  absl::Status PutOutput(const std::string& owner, const std::string& name, DType dtype,
                         int64_t rows, int64_t hidden, std::vector<grpc::Slice> slices);
  // FetchStaged: rows [row_offset, row_offset + rows) as sub-slices, and their tensor head.
  // Once every row of the output was fetched, it is freed.
  absl::Status Fetch(const std::string& owner, const std::string& name, int64_t row_offset,
                     int64_t rows, v1::Tensor* head, std::vector<grpc::Slice>* slices);
  // Drops tensors unused for ttl.
  void DropExpired(absl::Time now);
  int64_t staged_bytes() const;

 private:
  struct Entry {
    bool output = false;
    DType dtype = DType::kFloat32;
    int64_t rows = 0;
    int64_t hidden = 0;
    int64_t bytes = 0;
    std::shared_ptr<RelayBuffer> buffer;  // input
    std::map<int64_t, int64_t> parts;     // input: row_offset -> rows, reserved
    int64_t rows_written = 0;             // input: rows whose bytes are in the buffer
    std::vector<grpc::Slice> slices;      // output
    std::map<int64_t, int64_t> fetched;   // output: row_offset -> rows, fetched
    int64_t rows_fetched = 0;
    absl::Time last_used;
  };
  using Key = std::pair<std::string, std::string>;  // owner, name

  // The input entry for a part (made by the first part); reserves the part's rows.
  absl::StatusOr<std::shared_ptr<RelayBuffer>> ReservePart(const Key& key, int64_t total_rows,
                                                           int64_t row_offset, int64_t rows,
                                                           DType dtype, int64_t hidden);
  absl::Status Admit(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(std::map<Key, Entry>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  RelayPool* const pool_;
  const int64_t max_bytes_;
  const absl::Duration ttl_;
  mutable absl::Mutex mu_;
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moe

#endif  // MOED_SERVER_STAGING_H_
