// The client side of ForwardStream / BackwardStream (proto/moe.proto): a step whose tensor
// does not fit in one message. MoeClient::Forward / Backward use it by themselves when the
// tensor's bytes plus kStepMessageHeadroom pass ClientOptions::max_message_bytes.
//
//   grpc::ClientContext context;
//   auto stream = stub->ForwardStream(&context);
//   RETURN_IF_ERROR(StreamStep(stream.get(), std::move(request), &v1::ForwardRequest::mutable_x,
//                              x, &v1::ForwardResponse::mutable_out, piece_bytes, &response));
#ifndef MOED_CLIENT_STEP_STREAM_H_
#define MOED_CLIENT_STEP_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "engine/tensor.h"
#include "proto/moe.pb.h"

namespace moe {
namespace client {

// Room left in a message for the fields around a tensor's bytes.
constexpr int64_t kStepMessageHeadroom = int64_t{64} << 10;

// The bytes `tensor`'s datatype and shape declare (0 when they are invalid: the reader then
// only does not reserve).
size_t DeclaredTensorBytes(const v1::Tensor& tensor);

// Sends `first` (every field but the tensor `request_tensor` selects) with `value` as that
// tensor in pieces of piece_bytes, half-closes, and reads the answer into *response, joining
// the pieces of its tensor `response_tensor`. Returns the call's status.
template <typename Request, typename Response>
absl::Status StreamStep(grpc::ClientReaderWriter<Request, Response>* stream, Request first,
                        v1::Tensor* (Request::*request_tensor)(), const Tensor& value,
                        v1::Tensor* (Response::*response_tensor)(), size_t piece_bytes,
                        Response* response) {
  const absl::string_view bytes = value.bytes();
  const size_t piece = std::max<size_t>(piece_bytes, 1);
  v1::Tensor* head = (first.*request_tensor)();
  head->set_datatype(DTypeName(value.dtype()));
  head->clear_shape();
  for (int64_t d : value.shape()) head->add_shape(d);
  head->set_raw_data(bytes.data(), std::min(piece, bytes.size()));
  bool ok = stream->Write(first);
  Request next;
  for (size_t offset = piece; ok && offset < bytes.size(); offset += piece) {
    (next.*request_tensor)()->set_raw_data(bytes.data() + offset,
                                           std::min(piece, bytes.size() - offset));
    ok = stream->Write(next);
  }
  if (ok) stream->WritesDone();
  // Read the answer also after a failed write: the server's status says why.
  if (stream->Read(response)) {
    std::string* raw = (response->*response_tensor)()->mutable_raw_data();
    raw->reserve(DeclaredTensorBytes(*(response->*response_tensor)()));
    Response more;
    while (stream->Read(&more)) {
      raw->append((more.*response_tensor)()->raw_data());
      more.Clear();
    }
  }
  const grpc::Status status = stream->Finish();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_STEP_STREAM_H_
