// MoeServiceImpl: durable layers (moed --state_dir; server/durable_store.h). The workers
// write a layer's durable checkpoints as they write SaveCheckpoint's (engine/checkpoint.h,
// into a staging directory of the store), under the layer's turn right after the change that
// triggered it, so a checkpoint holds exactly the state of one optimizer step. moed restores
// the store's layers at start and reloads a layer's checkpoint whenever the workers lost it.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/config_convert.h"
#include "proto/status_convert.h"
#include "server/moe_service.h"

namespace moe {

absl::Status MoeServiceImpl::RestoreDurableLayers() {
  if (options_.durable_store == nullptr) return absl::OkStatus();
  const absl::Time now = absl::Now();
  for (const DurableLayer& record : options_.durable_store->layers()) {
    absl::Status valid = ValidateConfig(record.config, pool_->world_size());
    if (!valid.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("durable layer \"", record.name,
                                                        "\" does not fit ", pool_->world_size(),
                                                        " worker(s): ", valid.message()));
    }
    auto layer = std::make_shared<Layer>(record.name, SavedLimits());
    layer->id = layers_.NextLayerId();
    layer->config = record.config;
    {
      absl::MutexLock lock(&layer->mu);
      layer->accumulated.assign(record.config.num_experts, 0);
      layer->optimizer_step = record.optimizer_step;
      layer->durable = record;
      layer->durable_since = now;
      layer->load_durable = true;
      layer->gradients_dropped = true;  // whatever a client accumulated before the restart
    }
    layers_.Restore(layer);
  }
  return absl::OkStatus();
}

void MoeServiceImpl::AfterChange(Turn& turn, bool optimizer_step, bool force) {
  Layer& layer = turn.layer();
  if (!durable_schedule_.AfterChange(layer, optimizer_step, force, absl::Now())) return;
  const absl::Time start = absl::Now();
  absl::Status saved = SaveDurable(turn);
  absl::MutexLock lock(&layer.mu);
  if (saved.ok()) {
    layer.durable_error.clear();
  } else {
    layer.durable_error = std::string(saved.message());
    std::fprintf(stderr, "moed: layer %s: durable checkpoint failed: %s\n", layer.name.c_str(),
                 saved.ToString().c_str());
    return;
  }
  std::fprintf(stderr, "moed: layer %s: durable at optimizer step %lld (%s, %.0f ms)\n",
               layer.name.c_str(), static_cast<long long>(layer.durable.optimizer_step),
               layer.durable.checkpoint.c_str(), absl::ToDoubleMilliseconds(absl::Now() - start));
}

absl::Status MoeServiceImpl::SaveDurable(Turn& turn) {
  Layer& layer = turn.layer();
  DurableLayer record;
  int64_t step;
  {
    absl::MutexLock lock(&layer.mu);
    if (!layer.diverged.empty()) {
      return absl::FailedPreconditionError("the layer is diverged; its state is not saved");
    }
    record = layer.durable;
    step = layer.optimizer_step;
  }
  if (record.incarnation == 0) {
    return absl::FailedPreconditionError("the layer is not in the durable store");
  }
  DurableStore* store = options_.durable_store;
  ASSIGN_OR_RETURN(CheckpointRoot::Staging staging, store->BeginCheckpoint(record));
  internal::WorkerCheckpointRequest call;
  call.set_generation(turn.set.generation);
  call.set_layer_id(layer.id);
  call.set_directory(staging.path);
  absl::Status saved = FanOutOnLayer(
      turn, absl::Now() + options_.step_timeout,
      [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
        internal::WorkerEmpty empty;
        return FromGrpcStatus(stub->SaveCheckpoint(ctx, call, &empty));
      },
      /*collective=*/true);
  if (!saved.ok()) {
    store->AbortCheckpoint(staging);
    return saved;
  }
  RETURN_IF_ERROR(store->CommitCheckpoint(staging, &record, step));
  DurableSchedule::RecordSaved(layer, record, absl::Now());
  return absl::OkStatus();
}

absl::Status MoeServiceImpl::LoadDurable(const WorkerSet& set, Layer& layer) {
  DurableLayer record;
  {
    absl::MutexLock lock(&layer.mu);
    record = layer.durable;
  }
  if (record.incarnation != 0 && !record.checkpoint.empty()) {
    internal::WorkerCheckpointRequest call;
    call.set_generation(set.generation);
    call.set_layer_id(layer.id);
    call.set_directory(options_.durable_store->CheckpointPath(record));
    call.set_phase(internal::CHECKPOINT_LOAD);  // collective: the engine agrees across ranks
    RETURN_IF_ERROR(pool_->ForEachWorker(
        set, absl::Now() + options_.step_timeout,
        [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
          internal::WorkerEmpty empty;
          return FromGrpcStatus(stub->LoadCheckpoint(ctx, call, &empty));
        },
        /*collective=*/true));
  }
  DurableSchedule::RecordLoaded(layer, record, absl::Now());
  return absl::OkStatus();
}

}  // namespace moe
