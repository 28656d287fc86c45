// MoeServiceImpl on gRPC's callback API: the entry point of every RPC. Calls that may wait
// (a layer's turn, the workers) run their body on a HandlerPool thread (server/callback.h);
// ListLayers, GetLayer and GetStatus only read the front end's books and answer inline.
// Every call first checks the caller's role (server/auth.h; the table in server/README.md).
#include "proto/status_convert.h"
#include "server/auth.h"
#include "server/moe_service.h"

namespace moe {

namespace {

// Finishes a call on the callback thread that received it.
grpc::ServerUnaryReactor* FinishInline(grpc::CallbackServerContext* context,
                                       const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

// Checks the caller's role (server/auth.h) before the body is queued: a refused call never
// takes a handler thread.
template <typename Body>
grpc::ServerUnaryReactor* RunAuthorized(grpc::CallbackServerContext* context,
                                        const TokenAuthenticator* auth, Role role,
                                        HandlerPool* pool, Body body) {
  absl::Status allowed = Authorize(auth, *context, role);
  if (!allowed.ok()) return FinishInline(context, ToGrpcStatus(allowed));
  return RunUnary(context, pool, std::move(body));
}

}  // namespace

// Inside a stream body (grpc::Status result).
#define RETURN_IF_DENIED(role)                                                        \
  if (absl::Status allowed = Authorize(options_.auth, *context, role); !allowed.ok()) \
  return ToGrpcStatus(allowed)

grpc::ServerUnaryReactor* MoeServiceImpl::CreateLayer(grpc::CallbackServerContext* context,
                                                      const v1::CreateLayerRequest* request,
                                                      v1::CreateLayerResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kAdmin, &handlers_,
                       [=] { return DoCreateLayer(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::DeleteLayer(grpc::CallbackServerContext* context,
                                                      const v1::DeleteLayerRequest* request,
                                                      v1::DeleteLayerResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kAdmin, &handlers_,
                       [=] { return DoDeleteLayer(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                  const v1::ForwardRequest* request,
                                                  v1::ForwardResponse* response) {
  const Role role = request->keep_for_backward() ? Role::kTrain : Role::kInfer;
  return RunAuthorized(context, options_.auth, role, &handlers_, [=] {
    grpc::Status status = DoForward(context, request, response);
    ForgetRetiredShm();  // a region unregistered while this step used it
    return status;
  });
}

grpc::ServerUnaryReactor* MoeServiceImpl::Backward(grpc::CallbackServerContext* context,
                                                   const v1::BackwardRequest* request,
                                                   v1::BackwardResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kTrain, &handlers_, [=] {
    grpc::Status status = DoBackward(context, request, response);
    ForgetRetiredShm();  // a region unregistered while this step used it
    return status;
  });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ReleaseStep(grpc::CallbackServerContext* context,
                                                      const v1::ReleaseStepRequest* request,
                                                      v1::ReleaseStepResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kTrain, &handlers_,
                       [=] { return DoReleaseStep(context, request, response); });
}

grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* MoeServiceImpl::ForwardStream(
    grpc::CallbackServerContext* context) {
  using Stream = StreamReaderWriter<v1::ForwardRequest, v1::ForwardResponse>;
  // kInfer before a byte is read; kTrain as well once the first message asks to keep the
  // step (DoForwardStream).
  return Stream::Start(&handlers_, [=](Stream* stream) {
    RETURN_IF_DENIED(Role::kInfer);
    return DoForwardStream(context, stream);
  });
}

grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>* MoeServiceImpl::BackwardStream(
    grpc::CallbackServerContext* context) {
  using Stream = StreamReaderWriter<v1::BackwardRequest, v1::BackwardResponse>;
  return Stream::Start(&handlers_, [=](Stream* stream) {
    RETURN_IF_DENIED(Role::kTrain);
    return DoBackwardStream(context, stream);
  });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ZeroGradients(grpc::CallbackServerContext* context,
                                                        const v1::ZeroGradientsRequest* request,
                                                        v1::ZeroGradientsResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kTrain, &handlers_,
                       [=] { return DoZeroGradients(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ApplyOptimizer(grpc::CallbackServerContext* context,
                                                         const v1::ApplyOptimizerRequest* request,
                                                         v1::ApplyOptimizerResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kTrain, &handlers_,
                       [=] { return DoApplyOptimizer(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::UpdateExpertBias(
    grpc::CallbackServerContext* context, const v1::UpdateExpertBiasRequest* request,
    v1::UpdateExpertBiasResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kTrain, &handlers_,
                       [=] { return DoUpdateExpertBias(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::SaveCheckpoint(grpc::CallbackServerContext* context,
                                                         const v1::SaveCheckpointRequest* request,
                                                         v1::SaveCheckpointResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kAdmin, &handlers_,
                       [=] { return DoSaveCheckpoint(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::LoadCheckpoint(grpc::CallbackServerContext* context,
                                                         const v1::LoadCheckpointRequest* request,
                                                         v1::LoadCheckpointResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kAdmin, &handlers_,
                       [=] { return DoLoadCheckpoint(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ListLayers(grpc::CallbackServerContext* context,
                                                     const v1::ListLayersRequest* request,
                                                     v1::ListLayersResponse* response) {
  absl::Status allowed = Authorize(options_.auth, *context, Role::kRead);
  if (!allowed.ok()) return FinishInline(context, ToGrpcStatus(allowed));
  return FinishInline(context, DoListLayers(context, request, response));
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetLayer(grpc::CallbackServerContext* context,
                                                   const v1::GetLayerRequest* request,
                                                   v1::GetLayerResponse* response) {
  absl::Status allowed = Authorize(options_.auth, *context, Role::kRead);
  if (!allowed.ok()) return FinishInline(context, ToGrpcStatus(allowed));
  return FinishInline(context, DoGetLayer(context, request, response));
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetStatus(grpc::CallbackServerContext* context,
                                                    const v1::GetStatusRequest* request,
                                                    v1::GetStatusResponse* response) {
  absl::Status allowed = Authorize(options_.auth, *context, Role::kRead);
  if (!allowed.ok()) return FinishInline(context, ToGrpcStatus(allowed));
  return FinishInline(context, DoGetStatus(context, request, response));
}

grpc::ServerWriteReactor<v1::TensorChunk>* MoeServiceImpl::GetGradients(
    grpc::CallbackServerContext* context, const v1::GetGradientsRequest* request) {
  return StreamWriter<v1::TensorChunk>::Start(&handlers_,
                                              [=](StreamWriter<v1::TensorChunk>* writer) {
                                                RETURN_IF_DENIED(Role::kTrain);
                                                return DoGetGradients(context, request, writer);
                                              });
}

grpc::ServerWriteReactor<v1::TensorChunk>* MoeServiceImpl::GetWeights(
    grpc::CallbackServerContext* context, const v1::GetWeightsRequest* request) {
  return StreamWriter<v1::TensorChunk>::Start(&handlers_,
                                              [=](StreamWriter<v1::TensorChunk>* writer) {
                                                RETURN_IF_DENIED(Role::kRead);
                                                return DoGetWeights(context, request, writer);
                                              });
}

grpc::ServerReadReactor<v1::SetWeightsRequest>* MoeServiceImpl::SetWeights(
    grpc::CallbackServerContext* context, v1::SetWeightsResponse* response) {
  return StreamReader<v1::SetWeightsRequest>::Start(
      &handlers_, [=](StreamReader<v1::SetWeightsRequest>* reader) {
        RETURN_IF_DENIED(Role::kAdmin);
        return DoSetWeights(context, reader, response);
      });
}

grpc::ServerUnaryReactor* MoeServiceImpl::RegisterSystemSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSystemSharedMemoryRequest* request,
    v1::RegisterSystemSharedMemoryResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kInfer, &handlers_,
                       [=] { return DoRegisterSystemSharedMemory(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context, const v1::SystemSharedMemoryStatusRequest* request,
    v1::SystemSharedMemoryStatusResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kInfer, &handlers_,
                       [=] { return DoSystemSharedMemoryStatus(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::UnregisterSystemSharedMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterSystemSharedMemoryRequest* request,
    v1::UnregisterSystemSharedMemoryResponse* response) {
  return RunAuthorized(context, options_.auth, Role::kInfer, &handlers_,
                       [=] { return DoUnregisterSystemSharedMemory(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::RegisterCudaSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterCudaSharedMemoryRequest*,
    v1::RegisterCudaSharedMemoryResponse*) {
  absl::Status allowed = Authorize(options_.auth, *context, Role::kInfer);
  return FinishInline(context,
                      ToGrpcStatus(allowed.ok() ? absl::UnimplementedError(
                                                      "CUDA shared memory is not implemented yet; "
                                                      "use RegisterSystemSharedMemory")
                                                : allowed));
}

}  // namespace moe
