// MoeServiceImpl: cross-caller batching of forwards (server/forward_batcher.h decides who
// shares a step; this file decides who may, runs the merged step and splits it back).
//
// A merged step is one ordinary forward (RunForwardStep) of the members' x one after another:
// member i owns merged rows [begin_i, begin_i + tokens_i). Its answer is cut back per member:
// out as sub-slices of the workers' answers (no copy), tokens_per_expert counted from the
// member's rows of the experts each worker reports per token (routed_experts).
//
// Which forwards may share a step: those whose result per caller is exactly what docs/SPEC.md
// defines for the caller's tokens alone (server/README.md, "Cross-caller batching"):
//   - inference: keep_for_backward off (a kept step is one caller's StepContext on the workers;
//     see README for why training forwards are not merged yet), no timing asked, not
//     `unbatched`;
//   - x in the message, out in the answer (no shared memory, no staged tensors);
//   - a layer without batch statistics in its result: capacity_factor 0 (capacity counts the
//     step's tokens), aux_loss_coeff and z_loss_coeff 0 (the losses are means over the step),
//     compute dtype FP32 or BF16 (FP8 scales activations by their step-wide amax).
// Every row of the output then depends on its own token only (router, expert FFN, combine
// are per row, the CPU GEMMs in place-free row blocks: engine/cpu/cpu_gemm.cc;
// tests/server/batching_test checks the bits against each caller alone).
#include <algorithm>
#include <functional>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/layer_info.h"
#include "proto/status_convert.h"
#include "proto/tensor_convert.h"
#include "server/moe_service.h"
#include "server/step_memory.h"

namespace moe {
namespace {

// One caller's forward in a merged step: its input (references to its received bytes, kept
// alive here should the caller leave) and, once run, its answer.
struct MergedForwardMember : BatchMember {
  TensorBytes input;
  v1::ForwardResponse response;
  std::vector<grpc::Slice> output;
};

// A batched caller while its call runs: cancelled() of a caller that returned is true (its
// StepCaller is gone; the merged step may still ask).
class CallerContext {
 public:
  explicit CallerContext(const StepCaller* caller) : caller_(caller) {}
  bool Cancelled() {
    absl::MutexLock lock(&mu_);
    return caller_ == nullptr || caller_->cancelled();
  }
  void Leave() {
    absl::MutexLock lock(&mu_);
    caller_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  const StepCaller* caller_ ABSL_GUARDED_BY(mu_);
};

// The merged step's caller: it belongs to none of its members. It has their latest deadline
// and has left once every member left; no peer (merged forwards name no shared memory) and
// no client (they use no staging book).
class MergedStepCaller final : public StepCaller {
 public:
  MergedStepCaller(absl::Time deadline, std::function<bool()> cancelled)
      : deadline_(deadline), cancelled_(std::move(cancelled)) {}
  std::string peer() const override { return ""; }
  const std::string& client() const override { return client_; }
  absl::Time deadline() const override { return deadline_; }
  bool cancelled() const override { return cancelled_(); }

 private:
  const absl::Time deadline_;
  const std::function<bool()> cancelled_;
  const std::string client_;
};

// Whether a forward on a layer with `config` may share its step with other callers'.
bool BatchIndependent(const LayerConfig& config) {
  return config.capacity_factor == 0 && config.aux_loss_coeff == 0 && config.z_loss_coeff == 0 &&
         config.compute_dtype != DType::kFloat8E4M3;
}

// A [tokens, hidden] activation's datatype and shape (its bytes travel beside the message).
void ActivationHead(DType dtype, int64_t tokens, int64_t hidden, v1::Tensor* head) {
  head->set_datatype(DTypeName(dtype));
  head->add_shape(tokens);
  head->add_shape(hidden);
}

// Bytes [offset, offset + length) of `slices` (one after another) as sub-slices.
std::vector<grpc::Slice> SliceRange(const std::vector<grpc::Slice>& slices, size_t offset,
                                    size_t length) {
  std::vector<grpc::Slice> out;
  const size_t end = offset + length;
  size_t at = 0;
  for (const grpc::Slice& slice : slices) {
    const size_t next = at + slice.size();
    if (next > offset && at < end) {
      out.push_back(slice.sub(std::max(offset, at) - at, std::min(end, next) - at));
    }
    at = next;
    if (at >= end) break;
  }
  return out;
}

}  // namespace

std::optional<grpc::Status> MoeServiceImpl::ForwardInBatch(const StepCaller& caller,
                                                           const v1::ForwardRequest& request,
                                                           const TensorBytes& input,
                                                           v1::ForwardResponse* response,
                                                           std::vector<grpc::Slice>* output) {
  const ForwardBatchingOptions& batching = forward_batcher_.options();
  if (!batching.enabled || request.unbatched() || request.keep_for_backward() || request.timing() ||
      request.input_case() != v1::ForwardRequest::kX || request.has_out_shm() ||
      !request.out_staged().empty()) {
    return std::nullopt;
  }
  absl::StatusOr<std::shared_ptr<Layer>> found = FindLayer(request.layer());
  if (!found.ok() || !BatchIndependent((*found)->config)) return std::nullopt;
  // Anything DoForward would refuse runs there alone, to be refused with its own message.
  const int64_t hidden = (*found)->config.hidden;
  absl::StatusOr<DType> dtype = CheckTensorHead("x", request.x(), input.size());
  if (!dtype.ok() || (*dtype != DType::kFloat32 && *dtype != DType::kBFloat16) ||
      request.x().shape_size() != 2 || request.x().shape(1) != hidden) {
    return std::nullopt;
  }
  const int64_t tokens = request.x().shape(0);
  if (tokens <= 0 || tokens > batching.max_tokens) return std::nullopt;
  const int64_t need = ForwardStepBytes((*found)->config, tokens, pool_->world_size(), *dtype);
  if (!admission_.Admit("Forward", (*found)->name, tokens, need).ok()) return std::nullopt;

  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "Forward");
  auto member = std::make_shared<MergedForwardMember>();
  member->tokens = tokens;
  member->deadline = caller.deadline();
  // The merged step may ask after this call returned (the caller left): then it has gone.
  auto context = std::make_shared<CallerContext>(&caller);
  member->cancelled = [context] { return context->Cancelled(); };
  member->input = input;
  // Layer ids are never reused, so a layer created again under the name batches apart.
  const std::string key = absl::StrCat((*found)->id, "/", DTypeName(*dtype));
  std::shared_ptr<Layer> layer = *found;
  absl::Status status =
      forward_batcher_.Submit(key, member, [this, layer, dtype = *dtype](const BatchMembers& m) {
        RunMergedForward(layer, dtype, m);
      });
  context->Leave();
  if (status.ok()) {
    *response = std::move(member->response);
    *output = std::move(member->output);
  }
  return Finish("Forward", start, status);
}

void MoeServiceImpl::RunMergedForward(const std::shared_ptr<Layer>& layer, DType dtype,
                                      const BatchMembers& members) {
  const int64_t hidden = layer->config.hidden, top_k = layer->config.top_k;
  const int64_t experts = layer->config.num_experts;
  const size_t row_bytes = static_cast<size_t>(hidden) * DTypeSize(dtype);
  std::vector<TensorBytes> parts;
  int64_t total = 0;
  absl::Time deadline = absl::InfinitePast();
  for (const std::shared_ptr<BatchMember>& m : members) {
    parts.push_back(static_cast<MergedForwardMember&>(*m).input);
    total += m->tokens;
    deadline = std::max(deadline, m->deadline);
  }
  const MergedStepCaller step_caller(deadline, [&members] {
    return std::all_of(members.begin(), members.end(), [](const std::shared_ptr<BatchMember>& m) {
      return m->cancelled && m->cancelled();
    });
  });
  MergedStep merged;
  std::vector<int32_t> routed;
  merged.routed_experts = &routed;

  v1::ForwardRequest request;
  request.set_layer(layer->name);
  ActivationHead(dtype, total, hidden, request.mutable_x());
  const TensorBytes input = TensorBytes::Concat(parts);
  v1::ForwardResponse response;
  std::vector<grpc::Slice> output;
  absl::Status status = FromGrpcStatus(
      RunForwardStep(step_caller, request, input, &response, &output, &merged));
  if (status.ok() && (routed.size() != static_cast<size_t>(total * top_k) ||
                      std::any_of(routed.begin(), routed.end(),
                                  [experts](int32_t e) { return e < 0 || e >= experts; }))) {
    status = absl::InternalError(absl::StrCat("the workers reported ", routed.size(),
                                              " routed experts (or one out of range), expected ",
                                              total * top_k));
  }
  int64_t begin = 0;
  for (const std::shared_ptr<BatchMember>& m : members) {
    auto& member = static_cast<MergedForwardMember&>(*m);
    member.status = status;
    if (status.ok()) {
      std::vector<int64_t> counts(experts, 0);
      for (int64_t i = begin * top_k; i < (begin + member.tokens) * top_k; ++i) {
        ++counts[routed[i]];
      }
      ActivationHead(dtype, member.tokens, hidden, member.response.mutable_out());
      for (int64_t c : counts) member.response.add_tokens_per_expert(c);
      *member.response.mutable_load() = ComputeLoad(counts);
      member.output = SliceRange(output, begin * row_bytes, member.tokens * row_bytes);
    }
    begin += member.tokens;
  }
  if (status.ok()) {
    absl::MutexLock lock(&layer->mu);
    layer->forward_count += static_cast<int64_t>(members.size()) - 1;  // the step booked one
  }
  if (metrics_ != nullptr) {
    metrics_->ObserveMergedForward(layer->name, static_cast<int>(members.size()), total);
    for (const std::shared_ptr<BatchMember>& m : members) {
      metrics_->ObserveForwardQueueWait(layer->name, absl::ToDoubleSeconds(m->queue_wait));
    }
  }
}

}  // namespace moe
