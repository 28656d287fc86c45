#include "client/step_stream.h"

#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"

namespace moe {
namespace client {

absl::Status StreamStep(const std::shared_ptr<grpc::Channel>& channel,
                        grpc::ClientContext* context, const char* method,
                        const google::protobuf::MessageLite& first, int request_tensor,
                        const Tensor& value, int answer_tensor, size_t piece_bytes,
                        google::protobuf::MessageLite* response, TensorBytes* answer_bytes) {
  // Declared before the stream, so destroyed after it: waits until gRPC let go of the pieces.
  BorrowedBytes borrowed;
  // What a generated stub's ForwardStream does, with ByteBuffers for messages.
  const grpc::internal::RpcMethod rpc(method, grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel.get(), rpc, context));
  const absl::string_view bytes = value.bytes();
  const size_t piece = std::max<size_t>(piece_bytes, 1);
  const std::unique_ptr<google::protobuf::MessageLite> empty(first.New());
  bool ok = true;
  size_t offset = 0;
  do {  // a 0-byte tensor is one message
    const size_t length = std::min(piece, bytes.size() - offset);
    grpc::Slice slice = borrowed.Borrow(bytes.substr(offset, length));
    const grpc::ByteBuffer wire =
        offset == 0 ? EncodeWithTensor(first, request_tensor, TensorHead(value), std::move(slice))
                    : EncodeWithTensor(*empty, request_tensor, v1::Tensor(), std::move(slice));
    ok = stream->Write(wire);
    offset += length;
  } while (ok && offset < bytes.size());
  if (ok) stream->WritesDone();
  // Read the answer also after a failed write: the server's status says why.
  std::vector<TensorBytes> parts;
  absl::Status decoded = absl::OkStatus();
  grpc::ByteBuffer wire;
  const std::unique_ptr<google::protobuf::MessageLite> later(response->New());
  while (stream->Read(&wire)) {
    if (!decoded.ok()) continue;  // drain the stream so Finish() returns
    TensorBytes part;
    decoded = DecodeWithTensor(wire, answer_tensor, parts.empty() ? response : later.get(), &part);
    if (!decoded.ok()) {
      context->TryCancel();
      continue;
    }
    parts.push_back(std::move(part));
  }
  const absl::Status status = FromGrpcStatus(stream->Finish());
  if (!decoded.ok()) {
    return absl::InternalError(
        absl::StrCat("bad answer from server to ", method, ": ", decoded.message()));
  }
  if (!status.ok()) return status;
  *answer_bytes = TensorBytes::Concat(parts);
  return absl::OkStatus();
}

}  // namespace client
}  // namespace moe
