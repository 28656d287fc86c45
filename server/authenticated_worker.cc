#include "server/authenticated_worker.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/worker_call.h"

namespace moe {
namespace {

// The index of `method` in moe.internal.Worker, as the generated service numbers its methods.
int MethodIndex(const char* method) {
  return internal::WorkerForwardRequest::descriptor()
      ->file()
      ->FindServiceByName("Worker")
      ->FindMethodByName(method)
      ->index();
}

// Reads the one request of a unary call served as a stream and splits it: every field into
// *request but the raw_data of its tensor field `tensor_field`, left in the received buffer
// (*tensor_bytes) for the one copy into the engine's input.
grpc::Status ReadRequest(grpc::ServerUnaryStreamer<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                         int tensor_field, google::protobuf::MessageLite* request,
                         TensorBytes* tensor_bytes) {
  grpc::ByteBuffer wire;
  if (!stream->Read(&wire)) return grpc::Status(grpc::StatusCode::CANCELLED, "no request");
  const absl::Status decoded = DecodeWithTensor(wire, tensor_field, request, tensor_bytes);
  if (!decoded.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("request does not parse: ", decoded.message()));
  }
  return grpc::Status::OK;
}

// Sends `head` (the response without its tensor field) with field `tensor_field` = `tensor`,
// whose bytes are handed to gRPC, not copied; or `head` as it is when `has_tensor` (the
// output went to shared memory).
grpc::Status WriteAnswer(grpc::ServerUnaryStreamer<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                         const google::protobuf::MessageLite& head, bool has_tensor,
                         int tensor_field, Tensor tensor) {
  grpc::ByteBuffer answer;
  if (has_tensor) {
    answer = EncodeMessage(head);
  } else {
    const v1::Tensor tensor_head = TensorHead(tensor);
    answer = EncodeWithTensor(head, tensor_field, tensor_head, TakeTensorBytes(std::move(tensor)));
  }
  if (!stream->Write(answer)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the front end left");
  }
  return grpc::Status::OK;
}

}  // namespace

AuthenticatedWorkerService::AuthenticatedWorkerService(WorkerService* inner, ClusterSecret secret)
    : inner_(inner), secret_(std::move(secret)) {
  MarkMethodStreamed(MethodIndex("Forward"),
                     new grpc::internal::StreamedUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                         [this](grpc::ServerContext* context, BytesStream* stream) {
                           return ForwardBytes(context, stream);
                         }));
  MarkMethodStreamed(MethodIndex("Backward"),
                     new grpc::internal::StreamedUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                         [this](grpc::ServerContext* context, BytesStream* stream) {
                           return BackwardBytes(context, stream);
                         }));
}

grpc::Status AuthenticatedWorkerService::ForwardBytes(grpc::ServerContext* context,
                                                      BytesStream* stream) {
  grpc::Status status = secret_.Check(*context);
  internal::WorkerForwardRequest request;
  TensorBytes x_bytes;
  if (status.ok()) {
    status = ReadRequest(stream, internal::WorkerForwardRequest::kXFieldNumber, &request, &x_bytes);
  }
  internal::WorkerForwardResponse response;
  Tensor out;
  if (status.ok()) status = inner_->Forward(context, &request, x_bytes, &response, &out);
  if (!status.ok()) return status;
  return WriteAnswer(stream, response, response.has_out(),
                     internal::WorkerForwardResponse::kOutFieldNumber, std::move(out));
}

grpc::Status AuthenticatedWorkerService::BackwardBytes(grpc::ServerContext* context,
                                                       BytesStream* stream) {
  grpc::Status status = secret_.Check(*context);
  internal::WorkerBackwardRequest request;
  TensorBytes d_out_bytes;
  if (status.ok()) {
    status = ReadRequest(stream, internal::WorkerBackwardRequest::kDOutFieldNumber, &request,
                         &d_out_bytes);
  }
  internal::WorkerBackwardResponse response;
  Tensor d_x;
  if (status.ok()) status = inner_->Backward(context, &request, d_out_bytes, &response, &d_x);
  if (!status.ok()) return status;
  return WriteAnswer(stream, response, response.has_d_x(),
                     internal::WorkerBackwardResponse::kDXFieldNumber, std::move(d_x));
}

grpc::Status AuthenticatedWorkerService::Setup(grpc::ServerContext* context,
                                               const internal::SetupRequest* request,
                                               internal::SetupResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->Setup(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::CreateLayer(
    grpc::ServerContext* context, const internal::WorkerCreateLayerRequest* request,
    internal::WorkerCreateLayerResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->CreateLayer(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::DeleteLayer(grpc::ServerContext* context,
                                                     const internal::WorkerLayerRequest* request,
                                                     internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->DeleteLayer(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::Forward(grpc::ServerContext* context,
                                                 const internal::WorkerForwardRequest* request,
                                                 internal::WorkerForwardResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->Forward(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::Backward(grpc::ServerContext* context,
                                                  const internal::WorkerBackwardRequest* request,
                                                  internal::WorkerBackwardResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->Backward(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::ReleaseStep(
    grpc::ServerContext* context, const internal::WorkerReleaseStepRequest* request,
    internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->ReleaseStep(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::GetTensors(
    grpc::ServerContext* context, const internal::WorkerGetTensorsRequest* request,
    grpc::ServerWriter<v1::TensorChunk>* writer) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->GetTensors(context, request, writer) : denied;
}

grpc::Status AuthenticatedWorkerService::SetTensors(
    grpc::ServerContext* context, grpc::ServerReader<internal::WorkerSetTensorsRequest>* reader,
    internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->SetTensors(context, reader, response) : denied;
}

grpc::Status AuthenticatedWorkerService::ZeroGradients(grpc::ServerContext* context,
                                                       const internal::WorkerLayerRequest* request,
                                                       internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->ZeroGradients(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::ApplyOptimizer(
    grpc::ServerContext* context, const internal::WorkerOptimizerRequest* request,
    internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->ApplyOptimizer(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::CheckGradients(grpc::ServerContext* context,
                                                        const internal::WorkerLayerRequest* request,
                                                        internal::WorkerGradientCheck* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->CheckGradients(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::UpdateExpertBias(
    grpc::ServerContext* context, const internal::WorkerExpertBiasRequest* request,
    internal::WorkerExpertBiasResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->UpdateExpertBias(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::SaveCheckpoint(
    grpc::ServerContext* context, const internal::WorkerCheckpointRequest* request,
    internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->SaveCheckpoint(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::LoadCheckpoint(
    grpc::ServerContext* context, const internal::WorkerCheckpointRequest* request,
    internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->LoadCheckpoint(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::CommitStage(grpc::ServerContext* context,
                                                     const internal::WorkerCommitRequest* request,
                                                     internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->CommitStage(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::Ping(grpc::ServerContext* context,
                                              const internal::PingRequest* request,
                                              internal::PingResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->Ping(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::Shutdown(grpc::ServerContext* context,
                                                  const internal::WorkerEmpty* request,
                                                  internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->Shutdown(context, request, response) : denied;
}

grpc::Status AuthenticatedWorkerService::ForgetSharedMemory(
    grpc::ServerContext* context, const internal::ForgetSharedMemoryRequest* request,
    internal::WorkerEmpty* response) {
  grpc::Status denied = secret_.Check(*context);
  return denied.ok() ? inner_->ForgetSharedMemory(context, request, response) : denied;
}

}  // namespace moe
