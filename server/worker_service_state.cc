// moe-worker: the calls that read or change a layer's state (weights, gradients, optimizer,
// expert bias, checkpoints). The rest of WorkerService is in worker_service.cc.
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/checkpoint.h"
#include "engine/status_macros.h"
#include "proto/chunking.h"
#include "proto/config_convert.h"
#include "proto/status_convert.h"
#include "server/worker_service.h"

namespace moe {

grpc::Status WorkerService::GetTensors(grpc::ServerContext*,
                                       const internal::WorkerGetTensorsRequest* request,
                                       grpc::ServerWriter<v1::TensorChunk>* writer) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) -> absl::Status {
    for (const std::string& name : request->names()) {
      ASSIGN_OR_RETURN(Tensor t, request->kind() == internal::TENSOR_KIND_GRADIENT
                                     ? s->layer->GetGradient(name)
                                     : s->layer->GetParameter(name));
      RETURN_IF_ERROR(
          ChunkTensor(name, t, request->max_chunk_bytes(), [&](const v1::TensorChunk& chunk) {
            return writer->Write(chunk) ? absl::OkStatus()
                                        : absl::CancelledError("front end stopped reading");
          }));
    }
    return absl::OkStatus();
  });
}

grpc::Status WorkerService::SetTensors(
    grpc::ServerContext* context, grpc::ServerReader<internal::WorkerSetTensorsRequest>* reader,
    internal::WorkerEmpty*) {
  internal::WorkerSetTensorsRequest request;
  std::shared_ptr<LayerSlot> slot;
  std::unique_ptr<ChunkAssembler> assembler;
  uint64_t stage_id = 0;
  while (reader->Read(&request)) {
    if (slot == nullptr) {
      stage_id = request.stage_id();
      absl::StatusOr<std::shared_ptr<LayerSlot>> found =
          FindSlot(request.generation(), request.layer_id());
      if (!found.ok()) return ToGrpcStatus(found.status());
      slot = *found;
      // Expected shard shapes: the layer's current parameters.
      std::map<std::string, ExpectedTensor> expected;
      absl::MutexLock lock(&slot->mu);
      for (const std::string& name : slot->layer->ParameterNames()) {
        absl::StatusOr<Tensor> t = slot->layer->GetParameter(name);
        if (!t.ok()) return ToGrpcStatus(t.status());
        expected[name] = ExpectedTensor{t->dtype(), t->shape()};
      }
      assembler = std::make_unique<ChunkAssembler>(std::move(expected));
    }
    absl::Status status = assembler->Add(request.chunk());
    if (!status.ok()) return ToGrpcStatus(status);
  }
  if (slot == nullptr) return grpc::Status::OK;
  absl::StatusOr<std::vector<NamedTensor>> tensors = assembler->Finish();
  if (!tensors.ok()) return ToGrpcStatus(tensors.status());
  absl::MutexLock lock(&slot->mu);
  if (stage_id != 0) {  // kept for CommitStage (the front end's two-phase SetWeights)
    // A stream the front end gave up on keeps nothing (it may already stage something else).
    if (CallCancelled(context)) return ToGrpcStatus(absl::CancelledError("stage abandoned"));
    slot->DropStage();
    slot->staged_tensors = std::move(*tensors);
    slot->stage_id = stage_id;
    UpdateMemory(slot.get());
    return grpc::Status::OK;
  }
  for (const auto& named : *tensors) {
    absl::Status status = slot->layer->SetParameter(named.name, named.tensor);
    if (!status.ok()) return ToGrpcStatus(status);
  }
  UpdateMemory(slot.get());
  return grpc::Status::OK;
}

grpc::Status WorkerService::ZeroGradients(grpc::ServerContext*,
                                          const internal::WorkerLayerRequest* request,
                                          internal::WorkerEmpty*) {
  return OnLayer(request->generation(), request->layer_id(),
                 [&](LayerSlot* s) { return s->layer->ZeroGradients(); });
}

grpc::Status WorkerService::ApplyOptimizer(grpc::ServerContext*,
                                           const internal::WorkerOptimizerRequest* request,
                                           internal::WorkerEmpty*) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) -> absl::Status {
    if (request->op_id() != 0 && request->op_id() == s->last_op) return absl::OkStatus();
    ASSIGN_OR_RETURN(OptimizerConfig optimizer,
                     OptimizerFromProto(request->has_sgd() ? &request->sgd() : nullptr,
                                        request->has_adamw() ? &request->adamw() : nullptr));
    if (request->grad_scale() != 0) optimizer.grad_scale = request->grad_scale();
    RETURN_IF_ERROR(s->layer->ApplyOptimizer(optimizer));
    s->last_op = request->op_id();
    return absl::OkStatus();
  });
}

grpc::Status WorkerService::CheckGradients(grpc::ServerContext*,
                                           const internal::WorkerLayerRequest* request,
                                           internal::WorkerGradientCheck* response) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) -> absl::Status {
    ASSIGN_OR_RETURN(std::string name, s->layer->NonFiniteGradient());
    response->set_non_finite(name);
    return absl::OkStatus();
  });
}

grpc::Status WorkerService::UpdateExpertBias(grpc::ServerContext*,
                                             const internal::WorkerExpertBiasRequest* request,
                                             internal::WorkerExpertBiasResponse* response) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) -> absl::Status {
    if (request->op_id() == 0 || request->op_id() != s->last_op) {
      RETURN_IF_ERROR(s->layer->UpdateExpertBias(request->rate()));
      s->last_op = request->op_id();
    }
    ASSIGN_OR_RETURN(Tensor bias, s->layer->GetParameter("expert_bias"));
    for (int64_t i = 0; i < bias.num_elements(); ++i) {
      response->add_expert_bias(bias.data<float>()[i]);
    }
    return absl::OkStatus();
  });
}

grpc::Status WorkerService::SaveCheckpoint(grpc::ServerContext*,
                                           const internal::WorkerCheckpointRequest* request,
                                           internal::WorkerEmpty*) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) {
    return moe::SaveCheckpoint(*s->layer, request->directory());
  });
}

grpc::Status WorkerService::LoadCheckpoint(grpc::ServerContext* context,
                                           const internal::WorkerCheckpointRequest* request,
                                           internal::WorkerEmpty*) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) -> absl::Status {
    if (request->phase() == internal::CHECKPOINT_STAGE) {
      s->DropStage();  // one stage per layer: free the previous one first
      ASSIGN_OR_RETURN(StagedCheckpoint staged, StageCheckpoint(*s->layer, request->directory()));
      if (CallCancelled(context)) return absl::CancelledError("stage abandoned by the caller");
      s->staged = std::make_unique<StagedCheckpoint>(std::move(staged));
      s->stage_id = request->stage_id();
      return absl::OkStatus();
    }
    s->steps.clear();
    RETURN_IF_ERROR(moe::LoadCheckpoint(s->layer.get(), request->directory()));
    return s->layer->ZeroGradients();
  });
}

grpc::Status WorkerService::CommitStage(grpc::ServerContext*,
                                        const internal::WorkerCommitRequest* request,
                                        internal::WorkerEmpty*) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) -> absl::Status {
    if (request->abort()) {
      if (s->stage_id == request->stage_id()) s->DropStage();
      return absl::OkStatus();
    }
    if (s->stage_id == 0 || s->stage_id != request->stage_id()) {
      return absl::FailedPreconditionError(
          absl::StrCat("nothing staged under id ", request->stage_id()));
    }
    std::unique_ptr<StagedCheckpoint> checkpoint = std::move(s->staged);
    std::vector<NamedTensor> tensors = std::move(s->staged_tensors);
    s->DropStage();
    if (checkpoint != nullptr) {
      s->steps.clear();
      RETURN_IF_ERROR(InstallCheckpoint(s->layer.get(), *checkpoint));
      return s->layer->ZeroGradients();
    }
    for (const NamedTensor& named : tensors) {
      RETURN_IF_ERROR(s->layer->SetParameter(named.name, named.tensor));
    }
    if (!request->reset_optimizer()) return absl::OkStatus();
    RETURN_IF_ERROR(s->layer->ResetOptimizerState());
    return s->layer->ZeroGradients();
  });
}

}  // namespace moe
