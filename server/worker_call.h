// moed -> moe-worker step calls whose tensor bytes are borrowed from the client's request
// instead of copied. A Forward's x (a Backward's d_out) arrives in moed as one string; each
// worker's request is written by hand (proto/tensor_wire.h) as a grpc::ByteBuffer of a header
// slice and a slice of the rank's rows that points into the client's request: moed copies no
// tensor byte to send it (gRPC's own serialization would copy it twice: once into the sliced
// Tensor, once into the wire buffer). The worker answers the same way around its output tensor
// (TakeTensorBytes; server/authenticated_worker.cc).
//
//   BorrowedBytes borrowed;  // declared before the calls; waits for gRPC to let go
//   grpc::ByteBuffer wire = EncodeWithTensor(head, /*tensor_field=*/4, x_head,
//                                            borrowed.Borrow(rows));
//   RETURN_IF_ERROR(CallWorker(channel, ctx, kWorkerForwardMethod, wire, &answer));
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

// A blocking unary call of `method` with an encoded request; the answer parsed into
// *response. Cancellation and deadline come from `context`, as with a stub.
absl::Status CallWorker(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                        const char* method, const grpc::ByteBuffer& request,
                        google::protobuf::MessageLite* response);

}  // namespace moe

#endif  // MOED_SERVER_WORKER_CALL_H_
