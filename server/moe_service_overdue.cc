// MoeServiceImpl: calls on a layer that outlive their deadline, and the commit of two-phase
// changes (server/README.md, "Failure model"). The workers' synchronous handlers do not stop when
// moed gives up on a call, and a collective step cannot be abandoned by one rank alone; so an
// overdue call is left to finish on the workers while its caller gets DEADLINE_EXCEEDED at once,
// and the layer's next call waits (its FIFO turn) until every worker finished it: the ranks keep
// issuing that layer's collectives in the same order, nothing re-forms, and no other layer notices.
#include <cstdio>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"
#include "server/moe_service.h"

namespace moe {

absl::Status MoeServiceImpl::FanOutOnLayer(Turn& turn, absl::Time deadline,
                                           const WorkerPool::WorkerFn& fn, bool collective,
                                           uint64_t step_id, bool* partial) {
  FanOutOptions options;
  options.collective = collective;
  FanOutOutcome outcome;
  absl::Status status = pool_->ForEachWorker(turn.set, deadline, fn, options, &outcome);
  if (partial != nullptr) *partial = outcome.partial;
  if (outcome.overdue) {
    turn.set_overdue(step_id);
    std::fprintf(stderr,
                 "moed: layer %s: a call passed --step_timeout_ms (%s); the layer's next "
                 "call waits until the workers finished it\n",
                 turn.layer().name.c_str(), std::string(status.message()).c_str());
  }
  return status;
}

void MoeServiceImpl::DrainThenRelease(std::shared_ptr<Layer> layer, const WorkerSet& set,
                                      uint64_t step_id,
                                      WorkerMemoryReservations::Reservation memory) {
  // The workers still allocate what the call was admitted with: its reservation is held
  // until they finished it (shared: the body is copied into a std::function).
  auto reserved = std::make_shared<WorkerMemoryReservations::Reservation>(std::move(memory));
  auto body = [this, layer, set, step_id, reserved]() {
    Drain(layer, set, step_id);
    reserved->Release();
    layer->turn.Unlock();
    return grpc::Status::OK;
  };
  if (!handlers_.TrySubmit(body, [](const grpc::Status&) {})) body();
}

void MoeServiceImpl::Drain(const std::shared_ptr<Layer>& layer, const WorkerSet& set,
                           uint64_t step_id) {
  const absl::Time start = absl::Now();
  internal::WorkerReleaseStepRequest call;
  call.set_generation(set.generation);
  call.set_layer_id(layer->id);
  call.set_step_id(step_id);
  FanOutOptions options;
  options.cancelled = [this] { return stopping_drains_.load(); };
  FanOutOutcome outcome;
  // The workers' ReleaseStep waits for the layer's slot, i.e. for the overdue call to end;
  // it also frees the step that call may have saved (its caller never learnt its id).
  absl::Status status = pool_->ForEachWorker(
      set, start + options_.overdue_call_limit,
      [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
        internal::WorkerEmpty empty;
        return FromGrpcStatus(stub->ReleaseStep(ctx, call, &empty));
      },
      options, &outcome);
  if (outcome.overdue) {
    pool_->Restart(absl::StrCat("a call on layer \"", layer->name, "\" still runs after ",
                                absl::FormatDuration(options_.overdue_call_limit)));
  }
  // Any other failure: the workers re-form (dead worker, new generation) or the layer is gone;
  // either way nothing of the overdue call is left to wait for.
  std::fprintf(stderr, "moed: layer %s: the overdue call ended on the workers after %s (%s)\n",
               layer->name.c_str(), absl::FormatDuration(absl::Now() - start).c_str(),
               status.ok() ? "OK" : std::string(status.message()).c_str());
}

absl::Status MoeServiceImpl::CommitStage(Turn& turn, const char* method, uint64_t stage_id,
                                         bool reset_optimizer) {
  internal::WorkerCommitRequest call;
  call.set_generation(turn.set.generation);
  call.set_layer_id(turn.layer().id);
  call.set_stage_id(stage_id);
  call.set_reset_optimizer(reset_optimizer);
  // Not the client's deadline: a commit given up part-way would diverge the layer.
  return ChangeOnWorkers(
      turn, method, absl::Now() + options_.step_timeout,
      [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
        internal::WorkerEmpty empty;
        return FromGrpcStatus(stub->CommitStage(ctx, call, &empty));
      },
      /*collective=*/false);
}

void MoeServiceImpl::AbortStage(Turn& turn, uint64_t stage_id, const absl::Status& why) {
  if (absl::IsDeadlineExceeded(why)) return;
  absl::StatusOr<WorkerSet> set = pool_->Serving();
  if (!set.ok() || set->generation != turn.set.generation) return;  // gone with the generation
  internal::WorkerCommitRequest call;
  call.set_generation(turn.set.generation);
  call.set_layer_id(turn.layer().id);
  call.set_stage_id(stage_id);
  call.set_abort(true);
  pool_
      ->ForEachWorker(
          turn.set, absl::Now() + options_.step_timeout,
          [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
            internal::WorkerEmpty empty;
            return FromGrpcStatus(stub->CommitStage(ctx, call, &empty));
          },
          /*collective=*/false)
      .IgnoreError();
}

}  // namespace moe
