#include "server/authenticated_worker.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"
#include "server/worker_rings.h"
#include "server/worker_step_bytes.h"

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

// Reads the one request of a unary call served as a stream.
grpc::Status ReadWire(grpc::ServerUnaryStreamer<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                      grpc::ByteBuffer* wire) {
  if (!stream->Read(wire)) return grpc::Status(grpc::StatusCode::CANCELLED, "no request");
  return grpc::Status::OK;
}

grpc::Status WriteWire(grpc::ServerUnaryStreamer<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                       const grpc::ByteBuffer& answer) {
  if (!stream->Write(answer)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the front end left");
  }
  return grpc::Status::OK;
}

}  // namespace

AuthenticatedWorkerService::AuthenticatedWorkerService(WorkerService* inner, ClusterSecret secret)
    : inner_(inner),
      secret_(std::move(secret)),
      rings_([this](uint8_t kind, absl::Time, absl::string_view request) {
        return AnswerRingRecord(kind, request);
      }) {
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
  grpc::ByteBuffer wire, answer;
  if (status.ok()) status = ReadWire(stream, &wire);
  if (status.ok()) status = ForwardOnBytes(inner_, wire, &answer);
  return status.ok() ? WriteWire(stream, answer) : status;
}

grpc::Status AuthenticatedWorkerService::BackwardBytes(grpc::ServerContext* context,
                                                       BytesStream* stream) {
  grpc::Status status = secret_.Check(*context);
  grpc::ByteBuffer wire, answer;
  if (status.ok()) status = ReadWire(stream, &wire);
  if (status.ok()) status = BackwardOnBytes(inner_, wire, &answer);
  return status.ok() ? WriteWire(stream, answer) : status;
}

absl::StatusOr<std::string> AuthenticatedWorkerService::AnswerRingRecord(
    uint8_t kind, absl::string_view request) const {
  // The record's private copy outlives the call: the buffer only points at it.
  grpc::Slice slice(request.data(), request.size(), grpc::Slice::STATIC_SLICE);
  const grpc::ByteBuffer wire(&slice, 1);
  grpc::ByteBuffer answer;
  grpc::Status status;
  switch (static_cast<WorkerRingKind>(kind)) {
    case WorkerRingKind::kForward:
      status = ForwardOnBytes(inner_, wire, &answer);
      break;
    case WorkerRingKind::kBackward:
      status = BackwardOnBytes(inner_, wire, &answer);
      break;
    case WorkerRingKind::kReleaseStep:
      status = ReleaseStepOnBytes(inner_, wire, &answer);
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("step ring record of unknown kind ", kind));
  }
  if (!status.ok()) return FromGrpcStatus(status);
  return BufferBytes(answer);
}

grpc::Status AuthenticatedWorkerService::OpenStepChannels(
    grpc::ServerContext* context, const internal::OpenStepChannelsRequest* request,
    internal::OpenStepChannelsResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  if (!denied.ok()) return denied;
  rings_.Open(*request, response);
  return grpc::Status::OK;
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
