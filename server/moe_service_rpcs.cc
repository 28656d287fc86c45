// MoeServiceImpl on gRPC's callback API: the entry point of every RPC. Calls that may wait
// (a layer's turn, the workers) run their body on a HandlerPool thread (server/callback.h);
// ListLayers, GetLayer and GetStatus only read the front end's books and answer inline.
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

}  // namespace

grpc::ServerUnaryReactor* MoeServiceImpl::CreateLayer(grpc::CallbackServerContext* context,
                                                      const v1::CreateLayerRequest* request,
                                                      v1::CreateLayerResponse* response) {
  return RunUnary(context, &handlers_, [=] { return DoCreateLayer(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::DeleteLayer(grpc::CallbackServerContext* context,
                                                      const v1::DeleteLayerRequest* request,
                                                      v1::DeleteLayerResponse* response) {
  return RunUnary(context, &handlers_, [=] { return DoDeleteLayer(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                  const v1::ForwardRequest* request,
                                                  v1::ForwardResponse* response) {
  return RunUnary(context, &handlers_, [=] { return DoForward(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::Backward(grpc::CallbackServerContext* context,
                                                   const v1::BackwardRequest* request,
                                                   v1::BackwardResponse* response) {
  return RunUnary(context, &handlers_, [=] { return DoBackward(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ReleaseStep(grpc::CallbackServerContext* context,
                                                      const v1::ReleaseStepRequest* request,
                                                      v1::ReleaseStepResponse* response) {
  return RunUnary(context, &handlers_, [=] { return DoReleaseStep(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ZeroGradients(grpc::CallbackServerContext* context,
                                                        const v1::ZeroGradientsRequest* request,
                                                        v1::ZeroGradientsResponse* response) {
  return RunUnary(context, &handlers_, [=] { return DoZeroGradients(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ApplyOptimizer(grpc::CallbackServerContext* context,
                                                         const v1::ApplyOptimizerRequest* request,
                                                         v1::ApplyOptimizerResponse* response) {
  return RunUnary(context, &handlers_,
                  [=] { return DoApplyOptimizer(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::UpdateExpertBias(
    grpc::CallbackServerContext* context, const v1::UpdateExpertBiasRequest* request,
    v1::UpdateExpertBiasResponse* response) {
  return RunUnary(context, &handlers_,
                  [=] { return DoUpdateExpertBias(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::SaveCheckpoint(grpc::CallbackServerContext* context,
                                                         const v1::SaveCheckpointRequest* request,
                                                         v1::SaveCheckpointResponse* response) {
  return RunUnary(context, &handlers_,
                  [=] { return DoSaveCheckpoint(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::LoadCheckpoint(grpc::CallbackServerContext* context,
                                                         const v1::LoadCheckpointRequest* request,
                                                         v1::LoadCheckpointResponse* response) {
  return RunUnary(context, &handlers_,
                  [=] { return DoLoadCheckpoint(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ListLayers(grpc::CallbackServerContext* context,
                                                     const v1::ListLayersRequest* request,
                                                     v1::ListLayersResponse* response) {
  return FinishInline(context, DoListLayers(context, request, response));
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetLayer(grpc::CallbackServerContext* context,
                                                   const v1::GetLayerRequest* request,
                                                   v1::GetLayerResponse* response) {
  return FinishInline(context, DoGetLayer(context, request, response));
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetStatus(grpc::CallbackServerContext* context,
                                                    const v1::GetStatusRequest* request,
                                                    v1::GetStatusResponse* response) {
  return FinishInline(context, DoGetStatus(context, request, response));
}

grpc::ServerWriteReactor<v1::TensorChunk>* MoeServiceImpl::GetGradients(
    grpc::CallbackServerContext* context, const v1::GetGradientsRequest* request) {
  return StreamWriter<v1::TensorChunk>::Start(&handlers_,
                                              [=](StreamWriter<v1::TensorChunk>* writer) {
                                                return DoGetGradients(context, request, writer);
                                              });
}

grpc::ServerWriteReactor<v1::TensorChunk>* MoeServiceImpl::GetWeights(
    grpc::CallbackServerContext* context, const v1::GetWeightsRequest* request) {
  return StreamWriter<v1::TensorChunk>::Start(&handlers_,
                                              [=](StreamWriter<v1::TensorChunk>* writer) {
                                                return DoGetWeights(context, request, writer);
                                              });
}

grpc::ServerReadReactor<v1::SetWeightsRequest>* MoeServiceImpl::SetWeights(
    grpc::CallbackServerContext* context, v1::SetWeightsResponse* response) {
  return StreamReader<v1::SetWeightsRequest>::Start(
      &handlers_, [=](StreamReader<v1::SetWeightsRequest>* reader) {
        return DoSetWeights(context, reader, response);
      });
}

}  // namespace moe
