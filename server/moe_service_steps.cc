// MoeServiceImpl: Forward, Backward, ReleaseStep.
//
// Token split: T tokens over R workers, contiguous and in order; worker r gets
// T / R tokens plus one more when r < T % R. Every worker takes part, also with 0 tokens.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/phase_clock.h"
#include "engine/status_macros.h"
#include "proto/layer_info.h"
#include "proto/status_convert.h"
#include "proto/tensor_convert.h"
#include "server/moe_service.h"
#include "server/step_memory.h"
#include "server/worker_call.h"

namespace moe {
namespace {

// Offsets (in rows) of each worker's slice: slice r is rows [offsets[r], offsets[r + 1]).
std::vector<int64_t> SplitRows(int64_t tokens, int ranks) {
  std::vector<int64_t> offsets(ranks + 1, 0);
  for (int r = 0; r < ranks; ++r) {
    offsets[r + 1] = offsets[r] + tokens / ranks + (r < tokens % ranks ? 1 : 0);
  }
  return offsets;
}

// A client's shared memory (or CUDA IPC handle) reaches the workers only where they share
// moed's host: every worker joined with a loopback address (WorkerSet::local, as the relay
// decides). A worker on another host would open its own /dev/shm, or, in network namespaces
// that share one, silently depend on it; refused before the step touches the layer.
absl::Status CheckShmReachesWorkers(const ShmStep& shm, const WorkerSet& set) {
  if (set.local || (!shm.has_input() && !shm.has_output())) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "shared memory: the workers are not on moed's host (they joined with non-loopback "
      "addresses, moectl status lists them); send the tensors in the request, or run the "
      "workers on this host joined through 127.0.0.1");
}

// [T, H] activations: FP32 or BF16, rank 2, H = hidden, `bytes` (its raw_data's size)
// consistent.
absl::StatusOr<DType> CheckActivation(absl::string_view field, const v1::Tensor& t, size_t bytes,
                                      int64_t hidden) {
  ASSIGN_OR_RETURN(DType dtype, CheckTensorHead(field, t, bytes));
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".datatype: ", t.datatype(), " is not FP32 or BF16"));
  }
  if (t.shape_size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape: rank ", t.shape_size(), ", expected [tokens, ", hidden, "]"));
  }
  if (t.shape(1) != hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape[1]: ", t.shape(1), " != the layer's hidden size ", hidden));
  }
  return dtype;
}

// Worker request `head` plus rows [row_begin, row_end) of the step's input (datatype of
// `whole`, bytes `input`) as its field `tensor_field`, encoded around references to those
// bytes: received slices (or, for a tensor moed assembled, borrowed) — not copied.
grpc::ByteBuffer EncodeRows(const google::protobuf::MessageLite& head, int tensor_field,
                            const v1::Tensor& whole, const TensorBytes& input, int64_t row_begin,
                            int64_t row_end, size_t row_bytes, BorrowedBytes* borrowed) {
  v1::Tensor slice_head;
  slice_head.set_datatype(whole.datatype());
  slice_head.add_shape(row_end - row_begin);
  slice_head.add_shape(whole.shape(1));
  std::vector<grpc::Slice> rows;
  input.AppendSlices(row_begin * row_bytes, (row_end - row_begin) * row_bytes, borrowed, &rows);
  return EncodeWithTensor(head, tensor_field, slice_head, std::move(rows));
}

// The workers' output bytes in rank order as references to their answers (no copy), after
// checking that worker r sent `want(r)` bytes.
template <typename Want>
absl::Status CollectRows(const std::vector<TensorBytes>& bytes, absl::string_view what, Want want,
                         std::vector<grpc::Slice>* output) {
  for (size_t r = 0; r < bytes.size(); ++r) {
    if (bytes[r].size() != want(r)) {
      return absl::InternalError(absl::StrCat("worker ", r, " returned ", bytes[r].size(), " ",
                                              what, " bytes, expected ", want(r)));
    }
  }
  for (const TensorBytes& b : bytes) b.AppendSlices(0, b.size(), /*borrowed=*/nullptr, output);
  return absl::OkStatus();
}

// A [tokens, hidden] answer tensor's datatype and shape (its bytes travel beside the message).
void SetActivationHead(DType dtype, int64_t tokens, int64_t hidden, v1::Tensor* head) {
  head->set_datatype(DTypeName(dtype));
  head->add_shape(tokens);
  head->add_shape(hidden);
}

// One step's worker calls: each rank's answer, its tensor's bytes (references to the
// received answer, not copied) and the call's round trip.
template <typename Answer>
struct StepCalls {
  explicit StepCalls(int ranks) : answers(ranks), bytes(ranks), call_ms(ranks, 0.0) {}
  std::vector<Answer> answers;
  std::vector<TensorBytes> bytes;
  std::vector<double> call_ms;
  BorrowedBytes borrowed;  // slices of an input that moed assembled (ForwardStream etc.)
};

// The fields a step call carries its input in and its answer carries the output in.
template <typename Call>
struct StepFields {
  const char* method;
  v1::Tensor* (Call::*tensor)();
  internal::WorkerShmSlice* (Call::*input_shm)();
  internal::WorkerShmSlice* (Call::*output_shm)();
  int tensor_field;
  int answer_field;
};
const StepFields<internal::WorkerForwardRequest> kForwardFields{
    kWorkerForwardMethod,
    &internal::WorkerForwardRequest::mutable_x,
    &internal::WorkerForwardRequest::mutable_x_shm,
    &internal::WorkerForwardRequest::mutable_out_shm,
    internal::WorkerForwardRequest::kXFieldNumber,
    internal::WorkerForwardResponse::kOutFieldNumber};
const StepFields<internal::WorkerBackwardRequest> kBackwardFields{
    kWorkerBackwardMethod,
    &internal::WorkerBackwardRequest::mutable_d_out,
    &internal::WorkerBackwardRequest::mutable_d_out_shm,
    &internal::WorkerBackwardRequest::mutable_d_x_shm,
    internal::WorkerBackwardRequest::kDOutFieldNumber,
    internal::WorkerBackwardResponse::kDXFieldNumber};

// A step's input as the workers get it: rows [offsets[r], offsets[r + 1]) of `whole` (head of
// the request's tensor; its bytes `bytes`), each row_bytes long, or of the shared-memory input.
struct StepInput {
  const ShmStep& shm;
  const v1::Tensor& whole;
  const TensorBytes& bytes;
  std::vector<int64_t> offsets;
  size_t row_bytes;
};

// Worker r's call `call` (its own fields set) completed with its slice, rows [offsets[r],
// offsets[r + 1]), of the step's input: shared-memory slices (no tensor bytes in the call) or
// references to the request's bytes (EncodeRows); and the slice of the output region when the
// output goes there.
template <typename Call>
grpc::ByteBuffer EncodeStepCall(Call* call, const StepFields<Call>& fields, const StepInput& in,
                                int r, BorrowedBytes* borrowed) {
  const int64_t begin = in.offsets[r];
  const int64_t end = in.offsets[r + 1];
  if (in.shm.has_output()) in.shm.SliceOutput(begin, end, (call->*fields.output_shm)());
  if (in.shm.has_input()) {
    in.shm.SliceInput(begin, end, (call->*fields.tensor)(), (call->*fields.input_shm)());
    return EncodeMessage(*call);
  }
  return EncodeRows(*call, fields.tensor_field, in.whole, in.bytes, begin, end, in.row_bytes,
                    borrowed);
}

// The step's tensors that travel in gRPC messages to and from the workers (not in shared
// memory) fit one message per rank (CheckWorkerMessageSizes), checked before any worker call.
absl::Status CheckWorkerMessages(const StepInput& in, const char* in_field, const char* out_field,
                                 size_t out_row_bytes) {
  if (!in.shm.has_input()) {
    RETURN_IF_ERROR(CheckWorkerMessageSizes(in_field, in.offsets, in.row_bytes));
  }
  if (!in.shm.has_output()) {
    RETURN_IF_ERROR(CheckWorkerMessageSizes(out_field, in.offsets, out_row_bytes));
  }
  return absl::OkStatus();
}

// Worker r's step call: `head` (its own fields set) with its rows of the input, answered into
// `calls`; the round trip timed when `head` asks the worker for timing.
template <typename Call, typename Answer>
absl::Status CallStepWorker(const StepFields<Call>& fields, const Call& head, const StepInput& in,
                            const WorkerSet& set, int r, grpc::ClientContext* ctx,
                            StepCalls<Answer>* calls) {
  PhaseClock call_clock(head.timing());
  Call call = head;
  const grpc::ByteBuffer wire = EncodeStepCall(&call, fields, in, r, &calls->borrowed);
  absl::Status status =
      CallWorkerWithTensor(set.Route(r), ctx, fields.method, wire, fields.answer_field,
                           &calls->answers[r], &calls->bytes[r]);
  calls->call_ms[r] = call_clock.Total();
  return status;
}

// The fields of a Forward answer that rank 0's answer carries for all (losses, counts, load);
// returns the per-expert counts.
std::vector<int64_t> FillForwardAnswer(const internal::WorkerForwardResponse& first,
                                       v1::ForwardResponse* response) {
  response->set_aux_loss(first.aux_loss());
  response->set_z_loss(first.z_loss());
  std::vector<int64_t> counts(first.tokens_per_expert().begin(), first.tokens_per_expert().end());
  for (int64_t c : counts) response->add_tokens_per_expert(c);
  *response->mutable_load() = ComputeLoad(counts);
  return counts;
}

// moed's phases and each worker's (the workers' own timing, with moed's round trip added).
template <typename WorkerAnswer>
void FillStepTiming(const PhaseClock& clock, double queue_ms, double fanout_ms, double gather_ms,
                    const std::vector<double>& call_ms, const std::vector<WorkerAnswer>& answers,
                    v1::StepTiming* timing) {
  timing->set_moed_ms(clock.Total());
  timing->set_queue_ms(queue_ms);
  timing->set_fanout_ms(fanout_ms);
  timing->set_gather_ms(gather_ms);
  for (size_t r = 0; r < answers.size(); ++r) {
    v1::WorkerStepTiming* worker = timing->add_workers();
    *worker = answers[r].timing();
    worker->set_call_ms(call_ms[r]);
  }
}

// A step's moed phases and each worker's part, in metrics (null: none).
template <typename WorkerAnswer>
void ObserveStep(Metrics* metrics, const std::string& layer, const char* call, double queue_ms,
                 double fanout_ms, double gather_ms, const std::vector<double>& call_ms,
                 const std::vector<WorkerAnswer>& answers) {
  if (metrics == nullptr) return;
  metrics->ObserveStep(layer, call, queue_ms / 1e3, fanout_ms / 1e3, gather_ms / 1e3);
  for (size_t r = 0; r < answers.size(); ++r) {
    metrics->ObserveWorker(static_cast<int>(r), call, call_ms[r] / 1e3, answers[r].timing());
  }
}

// A Forward's tokens, per-expert counts and payload in metrics (null: none).
void CountForward(Metrics* metrics, const std::string& layer, int64_t tokens,
                  const std::vector<int64_t>& counts, size_t row_bytes, bool keep) {
  if (metrics == nullptr) return;
  metrics->CountTokens(layer, tokens, counts);
  const int64_t bytes = tokens * static_cast<int64_t>(row_bytes);
  metrics->CountPayload("Forward", bytes, bytes);
  if (keep) metrics->CountSavedSteps("created", 1);
}

}  // namespace

absl::StatusOr<MoeServiceImpl::StepTensor> MoeServiceImpl::ResolveStepInput(
    const std::string& client, const StepInputSource& source, const ShmStep& shm, int64_t hidden,
    StagedStepInput* staged) {
  const char* const field = source.field;
  if (source.staged_name != nullptr) {
    ASSIGN_OR_RETURN(*staged, TakeStaged(client, *source.staged_name, hidden));
  }
  const bool is_staged = staged->tensor.buffer != nullptr;
  StepTensor t;
  t.head = is_staged ? &staged->head : source.message_head;
  t.bytes = is_staged ? &staged->bytes : source.message_bytes;
  if (!source.in_message && !is_staged && !shm.has_input()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  }
  if (shm.has_input()) {
    t.dtype = shm.dtype();
    t.tokens = shm.tokens();
    return t;
  }
  ASSIGN_OR_RETURN(t.dtype, CheckActivation(field, *t.head, t.bytes->size(), hidden));
  t.tokens = t.head->shape(0);
  return t;
}

absl::Status MoeServiceImpl::KeepStepOrRefuse(Turn& turn, const StepCaller& caller,
                                              uint64_t step_id, int64_t saved_bytes) {
  // A client that left cannot use the step; a step over the byte budget is refused.
  Layer& layer = turn.layer();
  absl::Status refuse;
  if (caller.cancelled()) refuse = absl::CancelledError("client cancelled");
  {
    absl::MutexLock lock(&layer.mu);
    if (refuse.ok()) refuse = layer.saved.CheckBytes(saved_bytes);
    if (!refuse.ok()) layer.saved.Remove(step_id);
  }
  if (!refuse.ok()) ReleaseOnWorkers(turn.set, layer, {step_id});
  return refuse;
}

void MoeServiceImpl::BookForward(Layer& layer, const std::vector<int64_t>& counts, bool keep,
                                 uint64_t step_id, const SavedStep& step) {
  absl::MutexLock lock(&layer.mu);
  ++layer.forward_count;
  if (layer.accumulated.size() == counts.size()) {
    for (size_t e = 0; e < counts.size(); ++e) layer.accumulated[e] += counts[e];
  }
  if (keep) layer.saved.Add(step_id, step);
}

grpc::Status MoeServiceImpl::DoForward(const StepCaller& caller,
                                       const v1::ForwardRequest& request, const TensorBytes& input,
                                       v1::ForwardResponse* response,
                                       std::vector<grpc::Slice>* output) {
  // Several callers' inference forwards share one step (moe_service_batching.cc).
  if (std::optional<grpc::Status> batched =
          ForwardInBatch(caller, request, input, response, output)) {
    return *batched;
  }
  return RunForwardStep(caller, request, input, response, output, /*merged=*/nullptr);
}

grpc::Status MoeServiceImpl::RunForwardStep(const StepCaller& caller,
                                            const v1::ForwardRequest& request,
                                            const TensorBytes& input,
                                            v1::ForwardResponse* response,
                                            std::vector<grpc::Slice>* output,
                                            const MergedStep* merged) {
  const absl::Time start = absl::Now();
  std::optional<InflightRequest> inflight;
  if (merged == nullptr) inflight.emplace(metrics_, "Forward");
  auto run = [&]() -> absl::Status {
    // moed's own phases are always timed (metrics); the workers' only when the caller asks.
    PhaseClock clock(request.timing() || metrics_ != nullptr);
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request.layer()));
    // x and/or out in a client's shared memory (moe_service_shm.cc); leased until we return.
    ASSIGN_OR_RETURN(ShmStep shm, PrepareShm(caller, request, found->config.hidden));
    // Or x staged over several connections (StageTensor), taken out of the caller's book.
    StagedStepInput staged;
    StepInputSource source;
    source.field = "x";
    if (request.input_case() == v1::ForwardRequest::kXStaged) {
      source.staged_name = &request.x_staged();
    }
    source.in_message = request.has_x();
    source.message_head = &request.x();
    source.message_bytes = &input;
    ASSIGN_OR_RETURN(const StepTensor x, ResolveStepInput(caller.client(), source, shm,
                                                          found->config.hidden, &staged));
    const DType dtype = x.dtype;
    const int64_t tokens = x.tokens;
    RETURN_IF_ERROR(shm.CheckOutput(tokens, found->config.hidden, dtype));
    RETURN_IF_ERROR(
        CheckStagedOutput(caller.client(), "out_staged", request.out_staged(), request.has_out_shm()));
    const bool keep = request.keep_for_backward();
    auto check_budget = [&](const Layer& layer) -> absl::Status {
      absl::MutexLock lock(&layer.mu);
      return layer.saved.CheckRoom();
    };
    if (keep) RETURN_IF_ERROR(check_budget(*found));
    // Admission control (server/worker_memory_admission.h), before any worker allocates: the
    // step alone now, so one that cannot fit is refused without waiting for its turn; with the
    // turn, beside the steps running on other layers, reserving its estimate until it ends.
    const int64_t need = ForwardStepBytes(found->config, tokens, pool_->world_size(), dtype);
    RETURN_IF_ERROR(admission_.Admit("Forward", found->name, tokens, need));

    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn, TakeTurn(found, caller));
    Layer& layer = turn->layer();
    RETURN_IF_ERROR(CheckShmReachesWorkers(shm, turn->set));
    if (keep) RETURN_IF_ERROR(check_budget(layer));
    RETURN_IF_ERROR(admission_.Admit("Forward", layer.name, tokens, need, &turn->memory));
    // Workers on this host read x from, and write out to, moed's relay buffers.
    RelayRequest relayed;
    relayed.in_field = "x";
    relayed.input = x.bytes;
    relayed.staged = staged.tensor.buffer;
    relayed.in_dtype = dtype;
    relayed.out_field = "out";
    relayed.out_dtype = dtype;
    relayed.tokens = tokens;
    relayed.hidden = layer.config.hidden;
    ASSIGN_OR_RETURN(RelayStep relay, RelayLocally(turn->set, relayed, &shm));
    const int ranks = turn->set.size();
    const StepInput in{shm, *x.head, *x.bytes, SplitRows(tokens, ranks),
                       static_cast<size_t>(layer.config.hidden) * DTypeSize(dtype)};
    RETURN_IF_ERROR(CheckWorkerMessages(in, "x", "out", in.row_bytes));
    const uint64_t step_id = keep ? next_step_id_++ : 0;
    const double queue_ms = clock.Lap();

    internal::WorkerForwardRequest head;
    head.set_generation(turn->set.generation);
    head.set_layer_id(layer.id);
    head.set_step_id(step_id);
    head.set_timing(clock.enabled());  // metrics too: per-worker phases
    head.set_routed_experts(merged != nullptr);
    StepCalls<internal::WorkerForwardResponse> calls(ranks);
    // Overdue (past --step_timeout_ms): DEADLINE_EXCEEDED here, the workers finish the step
    // and release what it saved before the layer's next call (moe_service_overdue.cc).
    RETURN_IF_ERROR(relay.DiscardIfFailed(FanOutOnLayer(
        *turn, InternalDeadline(caller.deadline(), true),
        [&](int r, internal::Worker::Stub*, grpc::ClientContext* ctx) {
          return CallStepWorker(kForwardFields, head, in, turn->set, r, ctx, &calls);
        },
        /*collective=*/true, step_id)));
    const double fanout_ms = clock.Lap();

    // Gather the output slices in rank order.
    SetActivationHead(dtype, tokens, layer.config.hidden, response->mutable_out());
    int64_t saved_bytes = 0;
    for (int r = 0; r < ranks; ++r) saved_bytes += calls.answers[r].saved_bytes();
    // With out_shm the workers wrote out into the region: nothing to gather.
    RETURN_IF_ERROR(CollectRows(
        calls.bytes, "output",
        [&](size_t r) {
          return shm.has_output() ? 0 : (in.offsets[r + 1] - in.offsets[r]) * in.row_bytes;
        },
        output));
    if (relay.output) output->push_back(RelaySlice(relay.output, relay.output_bytes));
    const double gather_ms = clock.Lap();
    const std::vector<int64_t> counts = FillForwardAnswer(calls.answers[0], response);
    if (merged != nullptr) {
      for (const internal::WorkerForwardResponse& answer : calls.answers) {
        merged->routed_experts->insert(merged->routed_experts->end(),
                                       answer.routed_experts().begin(),
                                       answer.routed_experts().end());
      }
    }
    BookForward(layer, counts, keep, step_id, SavedStep{tokens, dtype, saved_bytes, absl::Now()});
    ObserveStep(metrics_, layer.name, "Forward", queue_ms, fanout_ms, gather_ms, calls.call_ms,
                calls.answers);
    CountForward(metrics_, layer.name, tokens, counts, in.row_bytes, keep);
    if (keep) {
      absl::Status kept = KeepStepOrRefuse(*turn, caller, step_id, saved_bytes);
      if (!kept.ok()) {
        response->Clear();
        output->clear();
        return kept;
      }
      response->set_step_id(step_id);
    }
    if (!request.out_staged().empty()) {
      RETURN_IF_ERROR(KeepStagedOutput(caller.client(), request.out_staged(), dtype, tokens,
                                       layer.config.hidden, output));
    }
    if (request.timing()) {
      FillStepTiming(clock, queue_ms, fanout_ms, gather_ms, calls.call_ms, calls.answers,
                     response->mutable_timing());
    }
    return absl::OkStatus();
  };
  if (merged != nullptr) return ToGrpcStatus(run());  // its members count themselves
  return Finish("Forward", start, run());
}

int64_t MoeServiceImpl::SavedBytesPerWorker(Layer& layer, uint64_t step_id) const {
  absl::MutexLock lock(&layer.mu);
  absl::StatusOr<SavedStep> step = layer.saved.Find(step_id, /*issued=*/true);
  // As admission_ counts it (per worker, rounded up).
  const int ranks = std::max(pool_->world_size(), 1);
  return step.ok() ? (step->bytes + ranks - 1) / ranks : 0;
}

int64_t MoeServiceImpl::SavedBytes(const Layer& layer) {
  absl::MutexLock lock(&layer.mu);
  return layer.saved.bytes();
}

absl::StatusOr<SavedStep> MoeServiceImpl::TakeSavedStep(Layer& layer, uint64_t step_id,
                                                        int64_t d_out_tokens, ShmStep* shm) {
  absl::MutexLock lock(&layer.mu);
  const bool issued = step_id < next_step_id_.load();
  ASSIGN_OR_RETURN(SavedStep step, layer.saved.Find(step_id, issued));
  if (d_out_tokens != step.tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("d_out.shape[0]: ", d_out_tokens, " != the step's tokens ", step.tokens));
  }
  RETURN_IF_ERROR(shm->CheckOutput(step.tokens, layer.config.hidden, step.dtype));
  // The step is consumed by this Backward, whatever its outcome.
  layer.saved.Remove(step_id);
  return step;
}

grpc::Status MoeServiceImpl::DoBackward(const StepCaller& caller,
                                        const v1::BackwardRequest& request,
                                        const TensorBytes& input, v1::BackwardResponse* response,
                                        std::vector<grpc::Slice>* output) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "Backward");
  auto run = [&]() -> absl::Status {
    PhaseClock clock(request.timing() || metrics_ != nullptr);  // as in Forward
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request.layer()));
    if (request.step_id() == 0) {
      return absl::FailedPreconditionError(
          "step_id: 0 is not a step (Forward returns 0 without keep_for_backward)");
    }
    // d_out and/or d_x in a client's shared memory (moe_service_shm.cc).
    ASSIGN_OR_RETURN(ShmStep shm, PrepareShm(caller, request, found->config.hidden));
    StagedStepInput staged;  // or staged (StageTensor), as in Forward
    StepInputSource source;
    source.field = "d_out";
    if (request.input_case() == v1::BackwardRequest::kDOutStaged) {
      source.staged_name = &request.d_out_staged();
    }
    source.in_message = request.has_d_out();
    source.message_head = &request.d_out();
    source.message_bytes = &input;
    ASSIGN_OR_RETURN(const StepTensor d_out, ResolveStepInput(caller.client(), source, shm,
                                                              found->config.hidden, &staged));
    const DType dtype = d_out.dtype;
    RETURN_IF_ERROR(
        CheckStagedOutput(caller.client(), "d_x_staged", request.d_x_staged(), request.has_d_x_shm()));
    const double d_aux = request.has_d_aux() ? request.d_aux() : 1.0;
    const double d_z_loss = request.has_d_z_loss() ? request.d_z_loss() : 1.0;
    if (!std::isfinite(d_aux)) return absl::InvalidArgumentError("d_aux: not finite");
    if (!std::isfinite(d_z_loss)) return absl::InvalidArgumentError("d_z_loss: not finite");
    // Admission control, as in Forward (d_out has the saved step's tokens, checked below).
    const int64_t need = BackwardStepBytes(found->config, d_out.tokens, pool_->world_size(), dtype,
                                           admission_.DeferredWgradFraction());
    RETURN_IF_ERROR(admission_.Admit("Backward", found->name, d_out.tokens, need));

    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn, TakeTurn(found, caller));
    Layer& layer = turn->layer();
    RETURN_IF_ERROR(CheckShmReachesWorkers(shm, turn->set));  // before the saved step is taken
    RETURN_IF_ERROR(admission_.Admit("Backward", layer.name, d_out.tokens, need, &turn->memory));
    // The saved step leaves the books here but stays on the workers until this Backward ends:
    // it joins the reservation first (server/worker_memory_admission.h). Under the turn nothing
    // else removes it meanwhile.
    turn->memory.Add(SavedBytesPerWorker(layer, request.step_id()));
    ASSIGN_OR_RETURN(const SavedStep step,
                     TakeSavedStep(layer, request.step_id(), d_out.tokens, &shm));
    RelayRequest relayed;
    relayed.in_field = "d_out";
    relayed.input = d_out.bytes;
    relayed.staged = staged.tensor.buffer;
    relayed.in_dtype = dtype;
    relayed.out_field = "d_x";
    relayed.out_dtype = step.dtype;
    relayed.tokens = step.tokens;
    relayed.hidden = layer.config.hidden;
    ASSIGN_OR_RETURN(RelayStep relay, RelayLocally(turn->set, relayed, &shm));
    const int ranks = turn->set.size();
    const StepInput in{shm, *d_out.head, *d_out.bytes, SplitRows(step.tokens, ranks),
                       static_cast<size_t>(layer.config.hidden) * DTypeSize(dtype)};
    RETURN_IF_ERROR(CheckWorkerMessages(
        in, "d_out", "d_x", static_cast<size_t>(layer.config.hidden) * DTypeSize(step.dtype)));
    const double queue_ms = clock.Lap();
    internal::WorkerBackwardRequest head;
    head.set_timing(clock.enabled());  // metrics too: per-worker phases
    head.set_generation(turn->set.generation);
    head.set_layer_id(layer.id);
    head.set_step_id(request.step_id());
    head.set_d_aux(d_aux);
    head.set_d_z_loss(d_z_loss);
    StepCalls<internal::WorkerBackwardResponse> calls(ranks);
    RETURN_IF_ERROR(relay.DiscardIfFailed(FanOutOnLayer(
        *turn, InternalDeadline(caller.deadline(), true),
        [&](int r, internal::Worker::Stub*, grpc::ClientContext* ctx) {
          return CallStepWorker(kBackwardFields, head, in, turn->set, r, ctx, &calls);
        },
        /*collective=*/true, request.step_id())));
    const double fanout_ms = clock.Lap();
    SetActivationHead(step.dtype, step.tokens, layer.config.hidden, response->mutable_d_x());
    // With d_x_shm the workers wrote d_x into the region: nothing to gather.
    const size_t d_x_row_bytes = layer.config.hidden * DTypeSize(step.dtype);
    RETURN_IF_ERROR(CollectRows(
        calls.bytes, "d_x",
        [&](size_t r) {
          return shm.has_output() ? 0 : (in.offsets[r + 1] - in.offsets[r]) * d_x_row_bytes;
        },
        output));
    if (relay.output) output->push_back(RelaySlice(relay.output, relay.output_bytes));
    const double gather_ms = clock.Lap();
    ObserveStep(metrics_, layer.name, "Backward", queue_ms, fanout_ms, gather_ms, calls.call_ms,
                calls.answers);
    if (metrics_ != nullptr) {
      const int64_t bytes = step.tokens * static_cast<int64_t>(in.row_bytes);
      metrics_->CountPayload("Backward", bytes,
                             step.tokens * layer.config.hidden * DTypeSize(step.dtype));
      metrics_->CountSavedSteps("used", 1);
    }
    if (!request.d_x_staged().empty()) {
      RETURN_IF_ERROR(KeepStagedOutput(caller.client(), request.d_x_staged(), step.dtype, step.tokens,
                                       layer.config.hidden, output));
    }
    if (request.timing()) {
      FillStepTiming(clock, queue_ms, fanout_ms, gather_ms, calls.call_ms, calls.answers,
                     response->mutable_timing());
    }
    return absl::OkStatus();
  };
  return Finish("Backward", start, run());
}

grpc::Status MoeServiceImpl::DoReleaseStep(const StepCaller& caller,
                                           const v1::ReleaseStepRequest* request,
                                           v1::ReleaseStepResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "ReleaseStep");
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request->layer()));
    // Works while the workers are down too: their steps are gone with their generation.
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn, TakeTurn(found, caller, /*require_serving=*/false,
                                                          /*allow_diverged=*/true));
    Layer& layer = turn->layer();
    {
      absl::MutexLock lock(&layer.mu);
      if (!layer.saved.Remove(request->step_id())) return absl::OkStatus();  // released = false
    }
    response->set_released(true);
    if (metrics_ != nullptr) metrics_->CountSavedSteps("released", 1);
    if (turn->set.size() > 0) ReleaseOnWorkers(turn->set, layer, {request->step_id()});
    return absl::OkStatus();
  };
  return Finish("ReleaseStep", start, run());
}

void MoeServiceImpl::ReleaseOnWorkers(const WorkerSet& set, const Layer& layer,
                                      const std::vector<uint64_t>& step_ids) {
  for (uint64_t step_id : step_ids) {
    internal::WorkerReleaseStepRequest call;
    call.set_generation(set.generation);
    call.set_layer_id(layer.id);
    call.set_step_id(step_id);
    // Best effort: the books no longer hold the step; a worker that misses the release frees
    // it at the next generation.
    pool_
        ->ForEachWorker(
            set, absl::Now() + options_.step_timeout,
            [&](int r, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
              return CallWorkerReleaseStep(set.Route(r), stub, ctx, call);
            },
            /*collective=*/false)
        .IgnoreError();
  }
}

}  // namespace moe
