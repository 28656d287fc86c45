// The client side of ForwardStream / BackwardStream (proto/moe.proto): a step whose tensor
// does not fit in one message. MoeClient::Forward / Backward use it by themselves when the
// tensor's bytes plus kStepMessageHeadroom pass ClientOptions::max_message_bytes.
//
// Every message is a grpc::ByteBuffer written and read around the tensor's bytes
// (proto/tensor_wire.h), as the unary steps are: a piece sent borrows its bytes from the
// caller's tensor, and the answer's pieces stay in the received slices until the caller's one
// copy (TensorFromWire). The wire is the protobuf encoding of the same messages.
//
//   grpc::ClientContext context;
//   v1::ForwardResponse response;
//   TensorBytes out_bytes;
//   RETURN_IF_ERROR(StreamStep(channel, &context, kForwardStreamMethod, request,
//                              v1::ForwardRequest::kXFieldNumber, x,
//                              v1::ForwardResponse::kOutFieldNumber, piece_bytes, &response,
//                              &out_bytes));
//   ASSIGN_OR_RETURN(Tensor out, TensorFromWire("out", response.out(), out_bytes));
#ifndef MOED_CLIENT_STEP_STREAM_H_
#define MOED_CLIENT_STEP_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "engine/tensor.h"
#include "google/protobuf/message_lite.h"
#include "proto/tensor_wire.h"

namespace moe {
namespace client {

inline constexpr char kForwardStreamMethod[] = "/moe.v1.MoeService/ForwardStream";
inline constexpr char kBackwardStreamMethod[] = "/moe.v1.MoeService/BackwardStream";

// Room left in a message for the fields around a tensor's bytes.
constexpr int64_t kStepMessageHeadroom = int64_t{64} << 10;

// Calls `method` (kForwardStreamMethod or kBackwardStreamMethod): sends `first` (every field
// but the tensor field `request_tensor`, which it must not set) with `value` as that tensor in
// pieces of piece_bytes, half-closes, and reads the answer: its first message's fields into
// *response (without raw_data of the tensor field `answer_tensor`), the bytes of all pieces of
// that tensor into *answer_bytes, not copied. Returns the call's status; an answer that does
// not parse is INTERNAL.
absl::Status StreamStep(const std::shared_ptr<grpc::Channel>& channel,
                        grpc::ClientContext* context, const char* method,
                        const google::protobuf::MessageLite& first, int request_tensor,
                        const Tensor& value, int answer_tensor, size_t piece_bytes,
                        google::protobuf::MessageLite* response, TensorBytes* answer_bytes);

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_STEP_STREAM_H_
