// gRPC transport settings for the connections that carry tensors (client -> moed,
// moed -> moe-worker), applied to both ends. gRPC's defaults suit small messages: 16 KiB HTTP/2
// frames, a 64 KiB initial stream window that the BDP probe only grows step by step, and
// socket reads of at most 4 MiB; a 64 MiB activation then takes thousands of frames and
// window updates. Chosen by measurement (docs/DECISIONS.md, docs/PERFORMANCE.md).
//
//   grpc::ChannelArguments args;
//   SetBulkTransportArgs(&args);          // or SetBulkTransportArgs(&server_builder)
//
// MOED_BULK_TRANSPORT=0 in the environment leaves gRPC's defaults: for A/B measurements only.
#ifndef MOED_TRANSPORT_BULK_TRANSPORT_H_
#define MOED_TRANSPORT_BULK_TRANSPORT_H_

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <cstring>

namespace moe {

// Calls set(name, value) for every setting.
template <typename Set>
void ForEachBulkTransportArg(Set set) {
  const char* off = std::getenv("MOED_BULK_TRANSPORT");
  if (off != nullptr && std::strcmp(off, "0") == 0) return;
  set(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 * 1024 * 1024 - 1);      // the largest HTTP/2 allows
  set(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 * 1024 * 1024);  // initial stream window
  set(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 64 * 1024 * 1024);
  set("grpc.experimental.tcp_min_read_chunk_size", 256 * 1024);
  set("grpc.experimental.tcp_max_read_chunk_size", 16 * 1024 * 1024);
}

inline void SetBulkTransportArgs(grpc::ChannelArguments* args) {
  ForEachBulkTransportArg([args](const char* name, int value) { args->SetInt(name, value); });
}

inline void SetBulkTransportArgs(grpc::ServerBuilder* builder) {
  ForEachBulkTransportArg(
      [builder](const char* name, int value) { builder->AddChannelArgument(name, value); });
}

}  // namespace moe

#endif  // MOED_TRANSPORT_BULK_TRANSPORT_H_
