// MoeServiceImpl: the optimizer (plain and data-parallel steps, the check for non-finite
// gradients before a step) and expert-bias updates. Each changes the layer on every worker
// (ChangeOnWorkers: applied at most once per worker, retried when partial).
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/config_convert.h"
#include "proto/status_convert.h"
#include "server/moe_service.h"

namespace moe {
absl::Status MoeServiceImpl::CheckExpectedStep(Layer& layer, int64_t expected) {
  absl::MutexLock lock(&layer.mu);
  if (layer.optimizer_step != expected) {
    return absl::AbortedError(absl::StrCat("layer \"", layer.name, "\" is at optimizer step ",
                                           layer.optimizer_step, ", not ", expected,
                                           " (expected_optimizer_step); nothing applied"));
  }
  if (layer.gradients_dropped) {
    return absl::AbortedError(absl::StrCat(
        "layer \"", layer.name,
        "\": a re-formation or moed restart dropped its gradients since the last ZeroGradients "
        "or optimizer step (expected_optimizer_step); nothing applied: ZeroGradients, then run "
        "the step's Forward and Backward again"));
  }
  return absl::OkStatus();
}

grpc::Status MoeServiceImpl::DoApplyOptimizer(grpc::ServerContextBase* context,
                                              const v1::ApplyOptimizerRequest* request,
                                              v1::ApplyOptimizerResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "ApplyOptimizer");
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request->layer()));
    RETURN_IF_ERROR(OptimizerFromProto(request->has_sgd() ? &request->sgd() : nullptr,
                                       request->has_adamw() ? &request->adamw() : nullptr)
                        .status());
    if (request->num_ranks() < 0 || request->num_ranks() > options_.max_dp_ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_ranks: must be in [0, ", options_.max_dp_ranks,
                       "] (moed --max_dp_ranks), got ", request->num_ranks()));
    }
    if (request->num_ranks() > 1) {
      return ApplyDataParallelStep(context, std::move(found), *request, response);
    }
    return ApplyOptimizerNow(context, std::move(found), *request, /*grad_scale=*/1.0, response);
  };
  return Finish("ApplyOptimizer", start, run());
}

absl::Status MoeServiceImpl::ApplyDataParallelStep(grpc::ServerContextBase* context,
                                                   std::shared_ptr<Layer> layer,
                                                   const v1::ApplyOptimizerRequest& request,
                                                   v1::ApplyOptimizerResponse* response) {
  DataParallelCall call;
  // The run belongs to the caller's identity: another token cannot complete its steps.
  RETURN_IF_ERROR(ParseDataParallelCall(request, ClientOf(*context), options_.max_dp_ranks, &call));
  DataParallelSteps::Arrival arrival =
      layer->dp_steps.Arrive(call, options_.dp_step_timeout, absl::FromChrono(context->deadline()),
                             [context] { return context->IsCancelled(); });
  if (!arrival.lead) {
    if (arrival.status.ok()) *response = arrival.answer;
    return arrival.status;
  }
  // Every rank's Backward has summed into the gradients: their mean is the sum / num_ranks.
  // In double on the workers; exact when num_ranks is a power of two.
  const absl::Status applied =
      ApplyOptimizerNow(context, layer, request, 1.0 / call.num_ranks, response);
  layer->dp_steps.Finish(call, applied, *response);
  return applied;
}

absl::Status MoeServiceImpl::ApplyOptimizerNow(grpc::ServerContextBase* context,
                                               std::shared_ptr<Layer> layer,
                                               const v1::ApplyOptimizerRequest& request,
                                               double grad_scale,
                                               v1::ApplyOptimizerResponse* response) {
  ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn, TakeTurn(std::move(layer), context));
  if (request.has_expected_optimizer_step()) {
    RETURN_IF_ERROR(CheckExpectedStep(turn->layer(), request.expected_optimizer_step()));
  }
  // One deadline for the check, the step and their retries: the caller hears within
  // --step_timeout_ms whichever of them a stopped worker holds up.
  const absl::Time deadline = InternalDeadline(context, true);
  std::string non_finite;
  RETURN_IF_ERROR(FindNonFiniteGradient(*turn, deadline, &non_finite));
  if (!non_finite.empty()) return RefuseOrSkipStep(*turn, deadline, request, non_finite, response);
  internal::WorkerOptimizerRequest call;
  call.set_generation(turn->set.generation);
  call.set_layer_id(turn->layer().id);
  if (request.has_sgd()) *call.mutable_sgd() = request.sgd();
  if (request.has_adamw()) *call.mutable_adamw() = request.adamw();
  if (grad_scale != 1.0) call.set_grad_scale(grad_scale);
  call.set_op_id(next_step_id_++);  // applied at most once per worker: retried if partial
  RETURN_IF_ERROR(ChangeOnWorkers(
      *turn, "ApplyOptimizer", deadline,
      [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
        internal::WorkerEmpty empty;
        return FromGrpcStatus(stub->ApplyOptimizer(ctx, call, &empty));
      },
      /*collective=*/false, /*gradients_only=*/false, /*idempotent=*/true));
  {
    absl::MutexLock lock(&turn->layer().mu);
    turn->layer().gradients_dropped = false;  // the step zeroed them
  }
  AfterChange(*turn, /*optimizer_step=*/true, /*force=*/false);
  absl::MutexLock lock(&turn->layer().mu);
  response->set_optimizer_step(turn->layer().optimizer_step);
  if (options_.durable_store != nullptr) {
    response->set_durable_optimizer_step(turn->layer().durable.optimizer_step);
  }
  return absl::OkStatus();
}

absl::Status MoeServiceImpl::FindNonFiniteGradient(Turn& turn, absl::Time deadline,
                                                   std::string* non_finite) {
  internal::WorkerLayerRequest call;
  call.set_generation(turn.set.generation);
  call.set_layer_id(turn.layer().id);
  std::vector<internal::WorkerGradientCheck> answers(turn.set.size());
  const WorkerPool::WorkerFn check = [&](int r, internal::Worker::Stub* stub,
                                         grpc::ClientContext* ctx) {
    answers[r].Clear();
    return FromGrpcStatus(stub->CheckGradients(ctx, call, &answers[r]));
  };
  bool partial = false;
  absl::Status checked = FanOutOnLayer(turn, deadline, check, /*collective=*/false, 0, &partial);
  if (!checked.ok() && partial && absl::Now() < deadline) {
    // Some workers answered: asked again once within the same generation and what is left of
    // the deadline, as ChangeOnWorkers retries the step itself. Read-only: a failure here
    // (a worker stopped past the deadline: DEADLINE_EXCEEDED) changes nothing and diverges
    // nothing.
    absl::StatusOr<WorkerSet> set = pool_->Serving();
    if (set.ok() && set->generation == turn.set.generation) {
      checked = FanOutOnLayer(turn, deadline, check, /*collective=*/false);
    }
  }
  RETURN_IF_ERROR(checked);
  non_finite->clear();
  for (const internal::WorkerGradientCheck& answer : answers) {
    if (!answer.non_finite().empty()) {
      *non_finite = answer.non_finite();
      break;
    }
  }
  return absl::OkStatus();
}

absl::Status MoeServiceImpl::RefuseOrSkipStep(Turn& turn, absl::Time deadline,
                                              const v1::ApplyOptimizerRequest& request,
                                              const std::string& tensor,
                                              v1::ApplyOptimizerResponse* response) {
  Layer& layer = turn.layer();
  if (!request.skip_non_finite()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer \"", layer.name, "\": gradient of ", tensor,
        " has non-finite values (NaN or Inf); nothing applied: the weights, optimizer state and "
        "optimizer_step are unchanged and the gradients kept (GetGradients); ZeroGradients and "
        "run the step again, or set skip_non_finite to skip such steps"));
  }
  internal::WorkerLayerRequest call;
  call.set_generation(turn.set.generation);
  call.set_layer_id(layer.id);
  RETURN_IF_ERROR(ChangeOnWorkers(
      turn, "ApplyOptimizer", deadline,
      [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
        internal::WorkerEmpty empty;
        return FromGrpcStatus(stub->ZeroGradients(ctx, call, &empty));
      },
      /*collective=*/false, /*gradients_only=*/true));
  metrics_->CountSkippedStep(layer.name);
  absl::MutexLock lock(&layer.mu);
  layer.gradients_dropped = false;  // zeroed, as by ZeroGradients
  response->set_skipped_non_finite(true);
  response->set_non_finite_tensor(tensor);
  response->set_optimizer_step(layer.optimizer_step);
  if (options_.durable_store != nullptr) {
    response->set_durable_optimizer_step(layer.durable.optimizer_step);
  }
  return absl::OkStatus();
}

grpc::Status MoeServiceImpl::DoUpdateExpertBias(grpc::ServerContextBase* context,
                                                const v1::UpdateExpertBiasRequest* request,
                                                v1::UpdateExpertBiasResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "UpdateExpertBias");
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request->layer()));
    if (!std::isfinite(request->rate()) || request->rate() < 0) {
      return absl::InvalidArgumentError("rate: must be finite and >= 0");
    }
    if (!found->config.use_expert_bias) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer: \"", found->name, "\" has no expert bias (config.use_expert_bias is false)"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn, TakeTurn(found, context));
    internal::WorkerExpertBiasRequest call;
    call.set_generation(turn->set.generation);
    call.set_layer_id(turn->layer().id);
    call.set_rate(request->rate());
    call.set_op_id(next_step_id_++);  // as ApplyOptimizer's
    std::vector<internal::WorkerExpertBiasResponse> answers(turn->set.size());
    RETURN_IF_ERROR(ChangeOnWorkers(
        *turn, "UpdateExpertBias", InternalDeadline(context, true),
        [&](int r, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
          answers[r].Clear();
          return FromGrpcStatus(stub->UpdateExpertBias(ctx, call, &answers[r]));
        },
        /*collective=*/false, /*gradients_only=*/false, /*idempotent=*/true));
    *response->mutable_expert_bias() = answers[0].expert_bias();
    {
      absl::MutexLock lock(&turn->layer().mu);
      turn->layer().accumulated.assign(turn->layer().config.num_experts, 0);
    }
    AfterChange(*turn, /*optimizer_step=*/false, /*force=*/false);
    return absl::OkStatus();
  };
  return Finish("UpdateExpertBias", start, run());
}

}  // namespace moe
