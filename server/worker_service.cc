#include "server/worker_service.h"

#include <unistd.h>

#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/phase_clock.h"
#include "engine/config.h"
#include "engine/config_agreement.h"
#include "engine/status_macros.h"
#include "proto/config_convert.h"
#include "proto/status_convert.h"
#include "proto/tensor_convert.h"

namespace moe {
namespace {

grpc::Status Grpc(const absl::Status& s) { return ToGrpcStatus(s); }

// The worker's phases of a step; the clock's next lap is the encode.
void FillTiming(PhaseClock& clock, double decode_ms, double engine_ms, size_t bytes_in,
                size_t bytes_out, const CommTraffic& traffic, v1::WorkerStepTiming* timing) {
  timing->set_all_to_all_bytes_sent(traffic.all_to_all_bytes_sent);
  timing->set_all_to_all_bytes_received(traffic.all_to_all_bytes_received);
  timing->set_all_to_all_ms(absl::ToDoubleMilliseconds(traffic.all_to_all_time));
  timing->set_decode_ms(decode_ms);
  timing->set_engine_ms(engine_ms);
  timing->set_encode_ms(clock.Lap());
  timing->set_handler_ms(clock.Total());
  timing->set_bytes_in(static_cast<int64_t>(bytes_in));
  timing->set_bytes_out(static_cast<int64_t>(bytes_out));
}

}  // namespace

bool WorkerService::CallCancelled(grpc::ServerContext* context) {
  if (context == nullptr) return false;  // called in-process (tests), not through gRPC
  // Checked directly as well: the synchronous API may learn of the deadline only when it
  // next touches the call.
  return context->IsCancelled() || std::chrono::system_clock::now() > context->deadline();
}

WorkerService::LayerSlot::~LayerSlot() {
  // The layer uses the backend and communicator: destroy it (and its steps) first.
  absl::MutexLock lock(&mu);
  steps.clear();
  layer.reset();
}

WorkerService::WorkerService(std::string device, std::shared_ptr<KeyValueStore> store,
                             EngineOptions engine)
    : device_(std::move(device)),
      store_(std::move(store)),
      engine_(std::move(engine)),
      shm_(/*pin_for_cuda=*/absl::StartsWith(device_, "cuda")) {}

WorkerService::~WorkerService() = default;

absl::Time WorkerService::last_ping() const {
  absl::MutexLock lock(&mu_);
  return last_ping_;
}

void WorkerService::NoteContact() {
  absl::MutexLock lock(&mu_);
  last_ping_ = absl::Now();
}

int64_t WorkerService::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

bool WorkerService::ready() const {
  absl::MutexLock lock(&mu_);
  return world_ != nullptr;
}

absl::StatusOr<std::shared_ptr<WorkerService::LayerSlot>> WorkerService::FindSlot(
    int64_t generation, uint64_t layer_id) {
  absl::MutexLock lock(&mu_);
  if (generation != generation_) {
    return absl::FailedPreconditionError(absl::StrCat("worker is in generation ", generation_,
                                                      ", call is for generation ", generation));
  }
  auto it = layers_.find(layer_id);
  if (it == layers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker has no layer id ", layer_id));
  }
  return it->second;
}

void WorkerService::UpdateMemory(LayerSlot* slot) {
  if (slot->device.backend == nullptr) return;
  slot->memory_bytes = static_cast<int64_t>(slot->device.backend->allocated_bytes());
  slot->peak_bytes = static_cast<int64_t>(slot->device.backend->peak_allocated_bytes());
}

grpc::Status WorkerService::Setup(grpc::ServerContext*, const internal::SetupRequest* request,
                                  internal::SetupResponse* response) {
  // Setups may overlap (a superseded one still waiting in its rendezvous): each works under
  // its own store prefix, and only the newest generation's world communicator is kept.
  std::map<uint64_t, std::shared_ptr<LayerSlot>> old_layers;
  std::shared_ptr<WorkerDevice> old_world;
  CommOptions options;
  options.timeout = absl::Milliseconds(std::max<int64_t>(1, request->collective_timeout_ms()));
  {
    absl::MutexLock lock(&mu_);
    // The previous generation's instances replace older retired ones of the same id (dropped
    // now). A layer the previous generation did not re-create (its set-up was superseded, or
    // the front end's re-creation failed part-way) keeps its older instance: still restorable.
    // The front end drops the instances of layers it no longer knows (DeleteLayer).
    for (auto& kv : layers_) {
      std::shared_ptr<LayerSlot>& retired = retired_[kv.first];
      if (retired != nullptr) old_layers[kv.first] = std::move(retired);
      retired = std::move(kv.second);
    }
    layers_.clear();
    old_world = std::move(world_);
    generation_ = request->generation();
    rank_ = request->rank();
    shm_.set_cuda_device(CudaOrdinal(device_, rank_));  // where CUDA regions are opened
    world_size_ = request->world_size();
    store_prefix_ = request->store_prefix();
    comm_options_ = options;
  }
  // Dropped outside mu_: a slot in use by a stuck step is freed when that step returns. The
  // retired layers stay in retired_ (their communicators are not used again).
  old_layers.clear();
  old_world.reset();
  if (on_ready_changed_) on_ready_changed_();  // not ready until this generation is up

  absl::StatusOr<WorkerDevice> world =
      MakeWorkerDevice(device_, store_, absl::StrCat(request->store_prefix(), "world"),
                       request->rank(), request->world_size(), options, engine_);
  if (!world.ok()) return Grpc(world.status());
  absl::Status barrier = world->comm->Barrier();
  if (!barrier.ok()) return Grpc(barrier);
  {
    absl::MutexLock lock(&mu_);
    if (generation_ == request->generation()) {
      world_ = std::make_shared<WorkerDevice>(std::move(*world));
    }
  }
  if (on_ready_changed_) on_ready_changed_();
  response->set_device(DeviceName(device_, request->rank()));
  return grpc::Status::OK;
}

grpc::Status WorkerService::CreateLayer(grpc::ServerContext* context,
                                        const internal::WorkerCreateLayerRequest* request,
                                        internal::WorkerCreateLayerResponse* response) {
  // The front end gave up (its deadline, or its client's cancellation): initialisation stops
  // between groups of experts, and the layer is not registered.
  const std::function<bool()> cancelled = [context] { return CallCancelled(context); };
  absl::StatusOr<LayerConfig> config = ConfigFromProto(request->config());
  if (!config.ok()) return Grpc(config.status());
  std::string prefix;
  int rank, size;
  CommOptions options;
  auto slot = std::make_shared<LayerSlot>();
  std::shared_ptr<LayerSlot> dropped;
  slot->name = request->name();
  {
    absl::MutexLock lock(&mu_);
    if (request->generation() != generation_) {
      return Grpc(absl::FailedPreconditionError("CreateLayer for another generation"));
    }
    if (layers_.count(request->layer_id()) != 0) {
      return Grpc(absl::AlreadyExistsError(absl::StrCat("layer id ", request->layer_id())));
    }
    prefix = absl::StrCat(store_prefix_, "layer/", request->layer_id(), "/");
    rank = rank_;
    size = world_size_;
    options = comm_options_;
    if (!request->restore()) {
      // Not restoring: free the previous instance before allocating the new one.
      dropped = std::move(retired_[request->layer_id()]);
      retired_.erase(request->layer_id());
    }
  }
  dropped.reset();
  absl::MutexLock slot_lock(&slot->mu);
  absl::StatusOr<WorkerDevice> device =
      MakeWorkerDevice(device_, store_, prefix, rank, size, options, engine_);
  if (!device.ok()) return Grpc(device.status());
  slot->device = std::move(*device);
  // Before any collective whose sizes follow from the config: all ranks must agree on it.
  absl::Status agree =
      CheckConfigAgreement(*config, slot->device.backend.get(), slot->device.comm.get());
  if (!agree.ok()) return Grpc(agree);
  absl::StatusOr<std::unique_ptr<MoeLayer>> layer = MoeLayer::Create(
      *config, slot->device.backend.get(), slot->device.comm.get(), cancelled, engine_.layer);
  if (!layer.ok()) return Grpc(layer.status());
  slot->layer = std::move(*layer);
  if (request->restore()) {
    std::shared_ptr<LayerSlot> previous;
    {
      absl::MutexLock lock(&mu_);
      auto it = retired_.find(request->layer_id());
      if (it != retired_.end()) {
        previous = std::move(it->second);
        retired_.erase(it);
      }
    }
    if (previous == nullptr) {
      return Grpc(absl::FailedPreconditionError(
          absl::StrCat("no previous instance of layer id ", request->layer_id(), " to restore")));
    }
    absl::Status copied = CopyLayerState(previous.get(), slot->layer.get());
    if (!copied.ok()) return Grpc(copied);
    response->set_restored(true);
  }
  UpdateMemory(slot.get());
  response->set_first_expert(slot->layer->first_expert());
  response->set_local_experts(slot->layer->local_experts());
  if (config->compute_dtype == DType::kFloat8E4M3) {
    response->set_fp8_gemms(Fp8GemmSetName(slot->layer->fp8_gemms()));
  }
  if (cancelled()) return Grpc(absl::CancelledError("CreateLayer cancelled by the front end"));
  absl::MutexLock lock(&mu_);
  if (request->generation() != generation_) {
    return Grpc(absl::FailedPreconditionError("generation changed during CreateLayer"));
  }
  layers_[request->layer_id()] = slot;
  return grpc::Status::OK;
}

absl::Status WorkerService::CopyLayerState(LayerSlot* from, MoeLayer* to) {
  // Waits for a call still running on the old instance (bounded by the collective timeout).
  absl::MutexLock lock(&from->mu);
  if (from->layer == nullptr) return absl::FailedPreconditionError("previous instance is empty");
  if (ConfigToString(from->layer->config()) != ConfigToString(to->config())) {
    return absl::FailedPreconditionError("previous instance has another config");
  }
  for (const std::string& name : from->layer->ParameterNames()) {
    ASSIGN_OR_RETURN(Tensor value, from->layer->GetParameter(name));
    RETURN_IF_ERROR(to->SetParameter(name, value));
  }
  for (const std::string& name : from->layer->StateNames()) {
    ASSIGN_OR_RETURN(Tensor value, from->layer->GetState(name));
    RETURN_IF_ERROR(to->SetState(name, value));
  }
  return absl::OkStatus();
}

grpc::Status WorkerService::DeleteLayer(grpc::ServerContext*,
                                        const internal::WorkerLayerRequest* request,
                                        internal::WorkerEmpty*) {
  std::shared_ptr<LayerSlot> slot, retired;
  {
    absl::MutexLock lock(&mu_);
    if (request->generation() != generation_) {
      return Grpc(absl::FailedPreconditionError("DeleteLayer for another generation"));
    }
    // Freed outside mu_ (a slot's destructor takes its mutex, which is held before mu_).
    auto old = retired_.find(request->layer_id());
    if (old != retired_.end()) {
      retired = std::move(old->second);
      retired_.erase(old);
    }
    auto it = layers_.find(request->layer_id());
    if (it == layers_.end()) return grpc::Status::OK;  // idempotent
    slot = std::move(it->second);
    layers_.erase(it);
  }
  return grpc::Status::OK;  // freed when the last in-flight call drops `slot`
}

grpc::Status WorkerService::OnLayer(int64_t generation, uint64_t layer_id,
                                    const std::function<absl::Status(LayerSlot*)>& fn) {
  absl::StatusOr<std::shared_ptr<LayerSlot>> slot = FindSlot(generation, layer_id);
  if (!slot.ok()) return Grpc(slot.status());
  LayerSlot* s = slot->get();
  absl::MutexLock lock(&s->mu);
  absl::Status status = fn(s);
  UpdateMemory(s);
  return Grpc(status);
}

grpc::Status WorkerService::Forward(grpc::ServerContext* context,
                                    const internal::WorkerForwardRequest* request,
                                    internal::WorkerForwardResponse* response) {
  Tensor out;
  grpc::Status status =
      Forward(context, request, TensorBytes(request->x().raw_data()), response, &out);
  if (status.ok() && !response->has_out()) TensorToProto(out, response->mutable_out());
  return status;
}

absl::StatusOr<ShmTensor> WorkerService::StepInput(absl::string_view field, const v1::Tensor& meta,
                                                   const internal::WorkerShmSlice* slice,
                                                   const TensorBytes& bytes) {
  if (slice != nullptr) return shm_.Input(field, meta, *slice);  // a view: read in place
  ShmTensor input;
  ASSIGN_OR_RETURN(input.tensor, TensorFromWire(field, meta, bytes));
  return input;
}

grpc::Status WorkerService::Forward(grpc::ServerContext*,
                                    const internal::WorkerForwardRequest* request,
                                    const TensorBytes& x_bytes,
                                    internal::WorkerForwardResponse* response, Tensor* out) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) -> absl::Status {
    PhaseClock clock(request->timing());
    ASSIGN_OR_RETURN(
        ShmTensor x_shm,
        StepInput("x", request->x(), request->has_x_shm() ? &request->x_shm() : nullptr, x_bytes));
    const Tensor& x = x_shm.tensor;
    // Into the client's region (the engine writes it in place; the response's out then holds
    // its datatype and shape only), or handed to the caller, who sends its bytes.
    const bool to_shm = request->has_out_shm();
    ShmTensor out_shm;
    if (to_shm) {
      ASSIGN_OR_RETURN(out_shm, shm_.Output("out", x.shape(), request->out_shm()));
    }
    const double decode_ms = clock.Lap();
    std::unique_ptr<StepContext> saved;
    const bool keep = request->step_id() != 0;
    const CommTraffic before = s->device.comm->traffic();
    ASSIGN_OR_RETURN(ForwardResult result,
                     s->layer->Forward(x, keep ? &saved : nullptr,
                                       to_shm ? &out_shm.tensor : nullptr,
                                       request->routed_experts()));
    const double engine_ms = clock.Lap();
    if (to_shm) SetTensorMeta(result.out, response->mutable_out());
    if (clock.enabled()) {
      FillTiming(clock, decode_ms, engine_ms, x.num_bytes(), result.out.num_bytes(),
                 s->device.comm->traffic() - before, response->mutable_timing());
    }
    if (!to_shm) *out = std::move(result.out);
    response->set_aux_loss(result.aux_loss);
    response->set_z_loss(result.z_loss);
    for (int64_t c : result.tokens_per_expert) response->add_tokens_per_expert(c);
    response->mutable_routed_experts()->Add(result.routed_experts.begin(),
                                            result.routed_experts.end());
    if (keep && saved != nullptr) {
      response->set_saved_bytes(static_cast<int64_t>(saved->bytes()));
      s->steps[request->step_id()] = std::move(saved);
    }
    return absl::OkStatus();
  });
}

grpc::Status WorkerService::Backward(grpc::ServerContext* context,
                                     const internal::WorkerBackwardRequest* request,
                                     internal::WorkerBackwardResponse* response) {
  Tensor d_x;
  grpc::Status status =
      Backward(context, request, TensorBytes(request->d_out().raw_data()), response, &d_x);
  if (status.ok() && !response->has_d_x()) TensorToProto(d_x, response->mutable_d_x());
  return status;
}

grpc::Status WorkerService::Backward(grpc::ServerContext*,
                                     const internal::WorkerBackwardRequest* request,
                                     const TensorBytes& d_out_bytes,
                                     internal::WorkerBackwardResponse* response, Tensor* d_x_out) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) -> absl::Status {
    PhaseClock clock(request->timing());
    ASSIGN_OR_RETURN(
        ShmTensor d_out_shm,
        StepInput("d_out", request->d_out(),
                  request->has_d_out_shm() ? &request->d_out_shm() : nullptr, d_out_bytes));
    const Tensor& d_out = d_out_shm.tensor;
    const bool to_shm = request->has_d_x_shm();
    ShmTensor d_x_shm;  // d_x: the forward's x's dtype (the slice's), d_out's shape
    if (to_shm) {
      ASSIGN_OR_RETURN(d_x_shm, shm_.Output("d_x", d_out.shape(), request->d_x_shm()));
    }
    const double decode_ms = clock.Lap();
    auto it = s->steps.find(request->step_id());
    if (it == s->steps.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("step_id ", request->step_id(), " is not held by this worker"));
    }
    // One backward per step: the context is freed whatever the outcome.
    std::unique_ptr<StepContext> saved = std::move(it->second);
    s->steps.erase(it);
    const CommTraffic before = s->device.comm->traffic();
    absl::StatusOr<Tensor> d_x = s->layer->Backward(
        *saved, d_out, request->d_aux(), request->d_z_loss(), to_shm ? &d_x_shm.tensor : nullptr);
    saved.reset();
    if (!d_x.ok()) return d_x.status();
    const double engine_ms = clock.Lap();
    if (to_shm) SetTensorMeta(*d_x, response->mutable_d_x());
    if (clock.enabled()) {
      FillTiming(clock, decode_ms, engine_ms, d_out.num_bytes(), d_x->num_bytes(),
                 s->device.comm->traffic() - before, response->mutable_timing());
    }
    if (!to_shm) *d_x_out = std::move(*d_x);
    return absl::OkStatus();
  });
}

grpc::Status WorkerService::ReleaseStep(grpc::ServerContext*,
                                        const internal::WorkerReleaseStepRequest* request,
                                        internal::WorkerEmpty*) {
  return OnLayer(request->generation(), request->layer_id(), [&](LayerSlot* s) {
    s->steps.erase(request->step_id());
    return absl::OkStatus();
  });
}

grpc::Status WorkerService::Ping(grpc::ServerContext*, const internal::PingRequest*,
                                 internal::PingResponse* response) {
  shm_.DropIdle(absl::Now());
  absl::MutexLock lock(&mu_);
  last_ping_ = absl::Now();
  response->set_rank(rank_);
  response->set_generation(generation_);
  response->set_device(DeviceName(device_, rank_));
  // Every layer's backend: parameters, gradients, optimizer state and the kept steps (their
  // buffers are backend allocations too). Retired instances still hold their memory.
  int64_t memory = 0, peak = 0;
  for (const auto* map : {&layers_, &retired_}) {
    for (const auto& kv : *map) {
      if (kv.second == nullptr) continue;
      memory += kv.second->memory_bytes;
      peak += kv.second->peak_bytes;
    }
  }
  response->set_memory_bytes(memory);
  response->set_peak_memory_bytes(peak);
  response->set_layers(static_cast<int32_t>(layers_.size()));
  for (const auto& kv : retired_) response->add_restorable_layers(kv.first);
  response->set_pid(getpid());
  response->set_memory_capacity_bytes(DeviceMemoryCapacity(device_, rank_));
  response->set_deferred_wgrad_fraction(engine_.layer.deferred_wgrad_fraction);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Shutdown(grpc::ServerContext*, const internal::WorkerEmpty*,
                                     internal::WorkerEmpty*) {
  // Two Shutdown calls may race: absl::Notification allows one Notify only.
  absl::MutexLock lock(&mu_);
  if (!shutdown_.HasBeenNotified()) shutdown_.Notify();
  return grpc::Status::OK;
}

grpc::Status WorkerService::ForgetSharedMemory(grpc::ServerContext*,
                                               const internal::ForgetSharedMemoryRequest* request,
                                               internal::WorkerEmpty*) {
  shm_.Forget({request->region_ids().begin(), request->region_ids().end()});
  return grpc::Status::OK;
}

}  // namespace moe
