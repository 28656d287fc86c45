// A grpc::ByteBuffer's bytes in one string: what a step channel's record carries instead of
// the gRPC message (server/moe_service_rpcs.cc, client/step_channel.h).
#ifndef MOED_PROTO_BYTE_BUFFER_H_
#define MOED_PROTO_BYTE_BUFFER_H_

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

namespace moe {

inline std::string FlattenByteBuffer(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string flat;
  if (!buffer.Dump(&slices).ok()) return flat;
  flat.reserve(buffer.Length());
  for (const grpc::Slice& slice : slices) {
    flat.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return flat;
}

// A ByteBuffer of one slice holding a copy of `bytes`.
inline grpc::ByteBuffer ByteBufferOf(const char* data, size_t size) {
  grpc::Slice slice(data, size);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace moe

#endif  // MOED_PROTO_BYTE_BUFFER_H_
