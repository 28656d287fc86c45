#include "server/worker_step_bytes.h"

#include <functional>
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

// A step call's body: `run` on the split request, its answer encoded around the output.
template <typename Request, typename Response>
grpc::Status StepOnBytes(
    const grpc::ByteBuffer& wire, int input_field, int output_field,
    bool (Response::*has_output)() const,
    const std::function<grpc::Status(const Request&, const TensorBytes&, Response*, Tensor*)>& run,
    grpc::ByteBuffer* answer) {
  Request request;
  TensorBytes input;
  grpc::Status status = ReadRequest(wire, input_field, &request, &input);
  Response response;
  Tensor output;
  if (status.ok()) status = run(request, input, &response, &output);
  if (!status.ok()) return status;
  *answer = EncodeAnswer(response, (response.*has_output)(), output_field, std::move(output));
  return grpc::Status::OK;
}

}  // namespace

grpc::Status ForwardOnBytes(WorkerService* service, const grpc::ByteBuffer& wire,
                            grpc::ByteBuffer* answer) {
  using Request = internal::WorkerForwardRequest;
  using Response = internal::WorkerForwardResponse;
  return StepOnBytes<Request, Response>(
      wire, Request::kXFieldNumber, Response::kOutFieldNumber, &Response::has_out,
      [&](const Request& request, const TensorBytes& x, Response* response, Tensor* out) {
        return service->Forward(nullptr, &request, x, response, out);
      },
      answer);
}

grpc::Status BackwardOnBytes(WorkerService* service, const grpc::ByteBuffer& wire,
                             grpc::ByteBuffer* answer) {
  using Request = internal::WorkerBackwardRequest;
  using Response = internal::WorkerBackwardResponse;
  return StepOnBytes<Request, Response>(
      wire, Request::kDOutFieldNumber, Response::kDXFieldNumber, &Response::has_d_x,
      [&](const Request& request, const TensorBytes& d_out, Response* response, Tensor* d_x) {
        return service->Backward(nullptr, &request, d_out, response, d_x);
      },
      answer);
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
