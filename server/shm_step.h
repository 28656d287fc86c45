// The shared-memory side of one Forward or Backward (proto/moe.proto, "Shared memory"): the
// input and/or output region the request names, leased for the step's duration, validated
// against the step's shape, and cut into each worker's row slice. A step that names no region
// has an empty ShmStep (has_input() and has_output() false).
//
//   ShmStep shm;
//   RETURN_IF_ERROR(shm.SetInput("x_shm", request.x_shm(), hidden, std::move(lease)));
//   RETURN_IF_ERROR(shm.SetOutput("out_shm", request.out_shm(), std::move(out_lease)));
//   RETURN_IF_ERROR(shm.CheckOutput(shm.tokens(), hidden, shm.dtype()));
//   shm.SliceInput(row_begin, row_end, call.mutable_x(), call.mutable_x_shm());
//   shm.SliceOutput(row_begin, row_end, call.mutable_out_shm());
#ifndef MOED_SERVER_SHM_STEP_H_
#define MOED_SERVER_SHM_STEP_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/dtype.h"
#include "proto/moe.pb.h"
#include "proto/worker.pb.h"
#include "server/shared_memory.h"

namespace moe {

class ShmStep {
 public:
  bool has_input() const { return static_cast<bool>(input_); }
  bool has_output() const { return static_cast<bool>(output_); }
  // Of the input (has_input() only).
  DType dtype() const { return dtype_; }
  int64_t tokens() const { return tokens_; }

  // An activation [T, hidden], FP32 or BF16, whose byte range lies inside the region, aligned
  // to its element size, byte_size exact (INVALID_ARGUMENT naming `field`).
  absl::Status SetInput(absl::string_view field, const v1::SharedMemoryTensor& tensor,
                        int64_t hidden, ShmLease lease);
  // Records the output range; checked by CheckOutput once the output's size is known.
  absl::Status SetOutput(absl::string_view field, const v1::SharedMemoryOutput& output,
                         ShmLease lease);
  // The output [tokens, hidden] of `dtype` fits the range (no-op without an output).
  absl::Status CheckOutput(int64_t tokens, int64_t hidden, DType dtype);

  // Worker slices of rows [row_begin, row_end).
  void SliceInput(int64_t row_begin, int64_t row_end, v1::Tensor* meta,
                  internal::WorkerShmSlice* slice) const;
  void SliceOutput(int64_t row_begin, int64_t row_end, internal::WorkerShmSlice* slice) const;

 private:
  static void Fill(const ShmRegion& region, int64_t offset, int64_t byte_size,
                   internal::WorkerShmSlice* slice);

  ShmLease input_;
  std::string datatype_;
  DType dtype_ = DType::kFloat32;
  int64_t tokens_ = 0;
  int64_t hidden_ = 0;
  int64_t input_offset_ = 0;
  int64_t input_bytes_ = 0;

  ShmLease output_;
  std::string output_field_;
  int64_t output_offset_ = 0;
  int64_t output_capacity_ = 0;
  int64_t output_row_bytes_ = 0;
  DType output_dtype_ = DType::kFloat32;  // set by CheckOutput
};

}  // namespace moe

#endif  // MOED_SERVER_SHM_STEP_H_
