// MoeServiceImpl: checkpoints on the server's disk, confined to --checkpoint_root
// (server/checkpoint_root.h). The workers write (and read) the files of their own experts
// (engine/checkpoint.h) in a staging directory of the root; the front end moves it into
// place once every worker succeeded, so a save appears complete or not at all. A load is
// two-phase: every worker stages (reads and verifies) its files, then all commit.
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/status_convert.h"
#include "server/moe_service.h"

namespace moe {

absl::StatusOr<CheckpointRoot*> MoeServiceImpl::Checkpoints() const {
  if (options_.checkpoint_root == nullptr) {
    return absl::FailedPreconditionError("checkpoints: this server has no --checkpoint_root");
  }
  return options_.checkpoint_root;
}

grpc::Status MoeServiceImpl::DoSaveCheckpoint(grpc::ServerContextBase* context,
                                              const v1::SaveCheckpointRequest* request,
                                              v1::SaveCheckpointResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "SaveCheckpoint");
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request->layer()));
    ASSIGN_OR_RETURN(CheckpointRoot * root, Checkpoints());
    // Checked before the turn: a refused path never waits for the layer.
    RETURN_IF_ERROR(CheckpointRoot::CheckName("directory", request->directory()).status());
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn, TakeTurn(found, context));
    ASSIGN_OR_RETURN(CheckpointRoot::Staging staging, root->BeginSave(request->directory()));
    {
      absl::MutexLock lock(&turn->layer().mu);
      staging.optimizer_step = turn->layer().optimizer_step;  // LoadCheckpoint restores it
    }
    internal::WorkerCheckpointRequest call;
    call.set_generation(turn->set.generation);
    call.set_layer_id(turn->layer().id);
    call.set_directory(staging.path);
    absl::Status saved = FanOutOnLayer(
        *turn, InternalDeadline(context, true),
        [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
          internal::WorkerEmpty empty;
          return FromGrpcStatus(stub->SaveCheckpoint(ctx, call, &empty));
        },
        /*collective=*/true);
    if (!saved.ok()) {
      root->AbortSave(staging);
      return saved;
    }
    RETURN_IF_ERROR(root->CommitSave(staging));
    response->set_directory(staging.name);
    return absl::OkStatus();
  };
  return Finish("SaveCheckpoint", start, run());
}

grpc::Status MoeServiceImpl::DoLoadCheckpoint(grpc::ServerContextBase* context,
                                              const v1::LoadCheckpointRequest* request,
                                              v1::LoadCheckpointResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "LoadCheckpoint");
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request->layer()));
    ASSIGN_OR_RETURN(CheckpointRoot * root, Checkpoints());
    ASSIGN_OR_RETURN(const std::string directory, root->ResolveForLoad(request->directory()));
    ASSIGN_OR_RETURN(const int64_t saved_step, root->SavedOptimizerStep(request->directory()));
    // The way back for a diverged layer: every worker loads the same state.
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn,
                     TakeTurn(found, context, /*require_serving=*/true, /*allow_diverged=*/true));
    Layer& layer = turn->layer();
    // Two phases: every worker reads and verifies its files (STAGE, changes nothing); only
    // when all succeeded does any install them (COMMIT). A bad checkpoint therefore fails
    // with the layer untouched and not diverged; only a COMMIT that fails part-way (a crash,
    // a worker that stops answering) diverges it.
    internal::WorkerCheckpointRequest call;
    call.set_generation(turn->set.generation);
    call.set_layer_id(layer.id);
    call.set_directory(directory);
    call.set_phase(internal::CHECKPOINT_STAGE);
    call.set_stage_id(next_step_id_++);  // unique per server
    // The client's deadline applies: a stage changes nothing, and a worker whose stage call
    // was given up keeps nothing of it.
    absl::Status staged = FanOutOnLayer(
        *turn, InternalDeadline(context, false),
        [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
          internal::WorkerEmpty empty;
          return FromGrpcStatus(stub->LoadCheckpoint(ctx, call, &empty));
        },
        /*collective=*/false);
    if (!staged.ok()) {
      AbortStage(*turn, call.stage_id(), staged);
      return staged;
    }
    // The workers drop their saved steps of this layer on commit.
    {
      absl::MutexLock lock(&layer.mu);
      layer.saved.Clear();
      layer.accumulated.assign(layer.config.num_experts, 0);
    }
    RETURN_IF_ERROR(CommitStage(*turn, "LoadCheckpoint", call.stage_id()));
    {
      absl::MutexLock lock(&layer.mu);
      layer.weights_reset = false;
      layer.ClearDiverged();
      layer.gradients_dropped = false;  // the commit zeroed them
      // The step the checkpoint was saved at, with the optimizer state the workers loaded
      // (a checkpoint of an older moed records none: the step keeps counting).
      if (saved_step >= 0) layer.optimizer_step = saved_step;
      response->set_optimizer_step(layer.optimizer_step);
    }
    AfterChange(*turn, /*optimizer_step=*/false, /*force=*/true);  // durable before the answer
    return absl::OkStatus();
  };
  return Finish("LoadCheckpoint", start, run());
}

}  // namespace moe
