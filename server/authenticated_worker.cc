#include "server/authenticated_worker.h"

namespace moe {

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
