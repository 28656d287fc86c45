// Named tensors as streams of moe.v1.TensorChunk (GetWeights, SetWeights, GetGradients, and
// the front end <-> worker GetTensors / SetTensors): splitting and reassembling. The chunks of
// one tensor carry its datatype and whole shape and contiguous element ranges in order,
// starting at 0 (proto/moe.proto, TensorChunk).
//
//   RETURN_IF_ERROR(ChunkTensor("wi", wi, kDefaultChunkBytes, [&](const v1::TensorChunk& c) {
//     return writer->Write(c) ? absl::OkStatus() : absl::CancelledError("reader gone");
//   }));
//
//   ChunkAssembler assembler(expected);  // or ChunkAssembler(): accept what the server sends
//   for (const auto& chunk : chunks) RETURN_IF_ERROR(assembler.Add(chunk));
//   ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, assembler.Finish());
#ifndef MOED_PROTO_CHUNKING_H_
#define MOED_PROTO_CHUNKING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/tensor.h"
#include "proto/moe.pb.h"

namespace moe {

// Chunk size when a request leaves it 0; also the client's ClientOptions::chunk_bytes.
inline constexpr int64_t kDefaultChunkBytes = 1 << 20;

// Emits `tensor` as chunks of at most max_chunk_bytes of raw data (rounded down to whole
// elements, at least one element; <= 0 means kDefaultChunkBytes). A 0-element tensor is one
// empty chunk. `emit` may move the chunk away. Stops at the first error `emit` returns and
// returns it.
absl::Status ChunkTensor(const std::string& name, const Tensor& tensor, int64_t max_chunk_bytes,
                         const std::function<absl::Status(v1::TensorChunk&&)>& emit);

struct ExpectedTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
};

// Reassembles a stream of chunks. Errors are INVALID_ARGUMENT naming the tensor; the whole
// tensor is allocated only once its first chunk passed the checks. Chunks of different
// tensors may interleave; a tensor's own chunks must be in order, and a name may not come
// back once its tensor is complete.
class ChunkAssembler {
 public:
  // Accepts any name; a tensor's datatype and shape are those of its first chunk (a shape
  // whose size overflows is refused before anything is allocated). For reading a peer that
  // chose the tensors, e.g. the client reading GetWeights.
  ChunkAssembler() = default;
  // Accepts only the names in `expected`, each with its datatype and shape. For reading a
  // peer that must send what this side expects, e.g. the front end reading SetWeights.
  explicit ChunkAssembler(std::map<std::string, ExpectedTensor> expected);

  absl::Status Add(const v1::TensorChunk& chunk);
  // Fails if a tensor is incomplete. Tensors in the order their first chunk arrived.
  absl::StatusOr<std::vector<NamedTensor>> Finish();

 private:
  struct Pending {
    NamedTensor named;
    int64_t filled = 0;  // elements received
    int64_t chunks = 0;  // chunks received
  };
  // The datatype and shape a tensor's first chunk must have.
  absl::StatusOr<ExpectedTensor> ExpectFirstChunk(const std::string& field,
                                                  const v1::TensorChunk& chunk) const;

  std::optional<std::map<std::string, ExpectedTensor>> expected_;  // nullopt: any tensor
  std::vector<Pending> tensors_;
};

}  // namespace moe

#endif  // MOED_PROTO_CHUNKING_H_
