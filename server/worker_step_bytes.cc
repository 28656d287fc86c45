#include "server/worker_step_bytes.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/tensor_wire.h"

namespace moe {
namespace {

// Splits a request: every field into *request but the raw_data of its tensor field
// `tensor_field`, left in the received buffer (*tensor_bytes) for the one copy into the
// engine's input.
grpc::Status ReadRequest(const grpc::ByteBuffer& wire, int tensor_field,
                         google::protobuf::MessageLite* request, TensorBytes* tensor_bytes) {
  const absl::Status decoded = DecodeWithTensor(wire, tensor_field, request, tensor_bytes);
  if (!decoded.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("request does not parse: ", decoded.message()));
  }
  return grpc::Status::OK;
}

// `head` (the response without its tensor field) with field `tensor_field` = `tensor`, whose
// bytes the buffer takes over, not copied; or `head` as it is when `has_tensor` (the output
// went to shared memory).
grpc::ByteBuffer EncodeAnswer(const google::protobuf::MessageLite& head, bool has_tensor,
                              int tensor_field, Tensor tensor) {
  if (has_tensor) return EncodeMessage(head);
  const v1::Tensor tensor_head = TensorHead(tensor);
  return EncodeWithTensor(head, tensor_field, tensor_head, TakeTensorBytes(std::move(tensor)));
}

}  // namespace

grpc::Status ForwardOnBytes(WorkerService* service, const grpc::ByteBuffer& wire,
                            grpc::ByteBuffer* answer) {
  internal::WorkerForwardRequest request;
  TensorBytes x_bytes;
  grpc::Status status =
      ReadRequest(wire, internal::WorkerForwardRequest::kXFieldNumber, &request, &x_bytes);
  internal::WorkerForwardResponse response;
  Tensor out;
  if (status.ok()) status = service->Forward(nullptr, &request, x_bytes, &response, &out);
  if (!status.ok()) return status;
  *answer = EncodeAnswer(response, response.has_out(),
                         internal::WorkerForwardResponse::kOutFieldNumber, std::move(out));
  return grpc::Status::OK;
}

grpc::Status BackwardOnBytes(WorkerService* service, const grpc::ByteBuffer& wire,
                             grpc::ByteBuffer* answer) {
  internal::WorkerBackwardRequest request;
  TensorBytes d_out_bytes;
  grpc::Status status =
      ReadRequest(wire, internal::WorkerBackwardRequest::kDOutFieldNumber, &request, &d_out_bytes);
  internal::WorkerBackwardResponse response;
  Tensor d_x;
  if (status.ok()) status = service->Backward(nullptr, &request, d_out_bytes, &response, &d_x);
  if (!status.ok()) return status;
  *answer = EncodeAnswer(response, response.has_d_x(),
                         internal::WorkerBackwardResponse::kDXFieldNumber, std::move(d_x));
  return grpc::Status::OK;
}

grpc::Status ReleaseStepOnBytes(WorkerService* service, const grpc::ByteBuffer& wire,
                                grpc::ByteBuffer* answer) {
  internal::WorkerReleaseStepRequest request;
  grpc::Slice flat;
  grpc::Status status = wire.DumpToSingleSlice(&flat);
  if (status.ok() && !request.ParseFromArray(flat.begin(), static_cast<int>(flat.size()))) {
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request does not parse");
  }
  internal::WorkerEmpty response;
  if (status.ok()) status = service->ReleaseStep(nullptr, &request, &response);
  if (!status.ok()) return status;
  *answer = EncodeMessage(response);
  return grpc::Status::OK;
}

}  // namespace moe
