// moed -> moe-worker step calls whose tensor bytes are borrowed from the client's request
// instead of copied. A Forward's x (a Backward's d_out) arrives in moed as one string; each
// worker's request is written by hand as a grpc::ByteBuffer of two slices:
//
//   [ header: the request's other fields, the tensor field's tag and length, the tensor's
//     datatype and shape, raw_data's tag and length ][ the rank's rows of the client's bytes ]
//
// which is exactly the protobuf encoding of the request (a parser cannot tell the
// difference). The second slice points into the client's request: moed copies no tensor byte
// to send it (gRPC's own serialization would copy it twice: once into the sliced Tensor,
// once into the wire buffer). The worker answers the same way around its output tensor
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

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "engine/tensor.h"
#include "google/protobuf/message_lite.h"
#include "proto/moe.pb.h"

namespace moe {

inline constexpr char kWorkerForwardMethod[] = "/moe.internal.Worker/Forward";
inline constexpr char kWorkerBackwardMethod[] = "/moe.internal.Worker/Backward";

// Slices that borrow caller-owned bytes. gRPC may hold a slice a little past the end of the
// call (a socket write in flight when a call is cancelled), so the destructor blocks until
// every borrowed slice was released: declare it after (so that it is destroyed before) the
// object that owns the bytes.
class BorrowedBytes {
 public:
  BorrowedBytes() = default;
  BorrowedBytes(const BorrowedBytes&) = delete;
  BorrowedBytes& operator=(const BorrowedBytes&) = delete;
  ~BorrowedBytes();

  // A slice over `bytes` (not copied; gRPC only reads it).
  grpc::Slice Borrow(absl::string_view bytes);

 private:
  static void Release(void* self);

  absl::Mutex mu_;
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
};

// A slice that owns `tensor` and points at its bytes (not copied): the tensor is freed when
// gRPC releases the slice. How a worker answers with its output.
grpc::Slice TakeTensorBytes(Tensor tensor);

// The encoding of `head` with field `tensor_field` (a moe.v1.Tensor, absent from `head`) set
// to `tensor_head` (datatype and shape, no raw_data) plus raw_data = the bytes of `bytes`
// (from BorrowedBytes::Borrow or TakeTensorBytes), which the buffer references.
grpc::ByteBuffer EncodeWithTensor(const google::protobuf::MessageLite& head, int tensor_field,
                                  const v1::Tensor& tensor_head, grpc::Slice bytes);

// `message` encoded into one slice (a call without tensor bytes, e.g. shared-memory steps).
grpc::ByteBuffer EncodeMessage(const google::protobuf::MessageLite& message);

// A blocking unary call of `method` with an encoded request; the answer parsed into
// *response. Cancellation and deadline come from `context`, as with a stub.
absl::Status CallWorker(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                        const char* method, const grpc::ByteBuffer& request,
                        google::protobuf::MessageLite* response);

}  // namespace moe

#endif  // MOED_SERVER_WORKER_CALL_H_
