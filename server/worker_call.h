// moed -> moe-worker step calls whose tensor bytes are never copied in moed. A Forward's x
// (a Backward's d_out) arrives in moed as received slices (server/moe_service.h: Forward and
// Backward are raw); each worker's request is written by hand (proto/tensor_wire.h) as a
// grpc::ByteBuffer of a header slice and references to the rank's rows of those slices. The
// worker answers the same way around its output tensor (TakeTensorBytes;
// server/authenticated_worker.cc), and moed keeps the answer's bytes as references to what
// it received, which become its own answer's bytes.
//
//   std::vector<grpc::Slice> rows;
//   x_bytes.AppendSlices(begin * row_bytes, n * row_bytes, &borrowed, &rows);
//   grpc::ByteBuffer wire = EncodeWithTensor(head, /*tensor_field=*/4, x_head, std::move(rows));
//   RETURN_IF_ERROR(CallWorkerWithTensor(channel, ctx, kWorkerForwardMethod, wire,
//                                        /*tensor_field=*/1, &answer, &out_bytes));
#ifndef MOED_SERVER_WORKER_CALL_H_
#define MOED_SERVER_WORKER_CALL_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/status.h"
#include "google/protobuf/message_lite.h"
#include "proto/tensor_wire.h"

namespace moe {

inline constexpr char kWorkerForwardMethod[] = "/moe.internal.Worker/Forward";
inline constexpr char kWorkerBackwardMethod[] = "/moe.internal.Worker/Backward";

// A blocking unary call of `method` with an encoded request (cancellation and deadline from
// `context`, as with a stub); the answer split around its field `tensor_field`
// (DecodeWithTensor): the fields in *head, the tensor's bytes in *bytes as references to the
// received slices (not copied). An answer that does not parse is INTERNAL.
absl::Status CallWorkerWithTensor(const std::shared_ptr<grpc::Channel>& channel,
                                  grpc::ClientContext* context, const char* method,
                                  const grpc::ByteBuffer& request, int tensor_field,
                                  google::protobuf::MessageLite* head, TensorBytes* bytes);

}  // namespace moe

#endif  // MOED_SERVER_WORKER_CALL_H_
