// Splitting named tensors into TensorChunk messages and reassembling them (proto/moe.proto,
// TensorChunk). Used for weights and gradients on the public API and between the front end
// and the workers. Chunks of one tensor are contiguous element ranges, in order.
//
//   RETURN_IF_ERROR(ChunkTensor("wi", wi, 1 << 20, [&](const v1::TensorChunk& c) {
//     return writer->Write(c) ? absl::OkStatus() : absl::CancelledError("client gone");
//   }));
//
//   ChunkAssembler assembler(expected);  // name -> (dtype, shape) it accepts
//   for (const auto& chunk : chunks) RETURN_IF_ERROR(assembler.Add(chunk));
//   ASSIGN_OR_RETURN(auto tensors, assembler.Finish());
#ifndef MOED_SERVER_CHUNKING_H_
#define MOED_SERVER_CHUNKING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/tensor.h"
#include "proto/moe.pb.h"

namespace moe {

constexpr int64_t kDefaultChunkBytes = 1 << 20;

// Emits `tensor` as chunks of at most max_chunk_bytes of raw data (rounded down to whole
// elements, at least one element). A 0-element tensor is one empty chunk. Stops at the first
// error `emit` returns.
absl::Status ChunkTensor(const std::string& name, const Tensor& tensor, int64_t max_chunk_bytes,
                         const std::function<absl::Status(const v1::TensorChunk&)>& emit);

struct ExpectedTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
};

// Reassembles a stream of chunks. Each tensor name must be in `expected` (else
// INVALID_ARGUMENT naming it) with the expected dtype and shape; memory is allocated only for
// a tensor that passed that check. Names may not repeat once complete.
class ChunkAssembler {
 public:
  explicit ChunkAssembler(std::map<std::string, ExpectedTensor> expected)
      : expected_(std::move(expected)) {}

  absl::Status Add(const v1::TensorChunk& chunk);
  // Fails if a tensor is incomplete. Tensors in the order their first chunk arrived.
  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> Finish();

 private:
  struct Pending {
    std::string name;
    Tensor tensor;
    int64_t filled = 0;  // elements received
    int64_t chunks = 0;  // chunks received
  };
  std::map<std::string, ExpectedTensor> expected_;
  std::vector<Pending> tensors_;
};

}  // namespace moe

#endif  // MOED_SERVER_CHUNKING_H_
