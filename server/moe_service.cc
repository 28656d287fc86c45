// MoeServiceImpl: layers, status, and the helpers shared by the step and weight handlers
// (moe_service_steps.cc, moe_service_weights.cc).
#include "server/moe_service.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"
#include "proto/config_convert.h"
#include "proto/layer_info.h"
#include "proto/status_convert.h"
#include "server/step_memory.h"

namespace moe {

MoeServiceImpl::MoeServiceImpl(ServiceOptions options, WorkerPool* pool, Metrics* metrics)
    : options_(std::move(options)),
      pool_(pool),
      metrics_(metrics),
      admission_(options_.worker_memory_bytes, pool->world_size(),
                 {[pool] { return pool->WorkerStatuses(); },
                  [pool] { return pool->LargestDeferredWgradFraction(); },
                  [this](const WorkerMemoryAdmission::LayerVisitor& visit) {
                    VisitHeldLayers(visit);
                  }}),
      handlers_(options_.handler_threads, options_.handler_threads_per_client) {
  if (options_.allow_client_shm) {
    shm_ = std::make_unique<SharedMemoryRegistry>(options_.shm_idle_timeout);
  }
  if (options_.shm_relay) relay_ = std::make_unique<RelayPool>(options_.shm_relay_max_bytes);
  if (options_.allow_client_shm) {
    StepChannelOptions channels;
    channels.max_channels = options_.max_step_channels;
    channels.max_per_owner = options_.max_step_channels_per_client;
    channels.max_ring_bytes = options_.max_step_channel_bytes;
    channels.max_spin = options_.step_channel_spin;
    channels.default_ring_bytes = std::min(channels.default_ring_bytes, channels.max_ring_bytes);
    step_channels_ = std::make_unique<StepChannels>(channels);
  }
  staging_ = std::make_unique<StagingTable>(relay_.get(), options_.shm_relay_max_bytes,
                                            options_.staged_ttl);
  const bool expire_steps = options_.saved_step_ttl > absl::ZeroDuration();
  // A few rounds per TTL, at most one a second.
  const absl::Duration period =
      expire_steps ? std::max(absl::Milliseconds(10),
                              std::min(absl::Seconds(1), options_.saved_step_ttl / 4))
                   : absl::Seconds(1);
  housekeeping_ = std::thread([this, period, expire_steps] {
    absl::MutexLock lock(&housekeeping_mu_);
    while (!housekeeping_mu_.AwaitWithTimeout(absl::Condition(&stopping_), period)) {
      housekeeping_mu_.Unlock();
      if (expire_steps) ExpireSavedSteps();
      HousekeepShm();
      staging_->DropExpired(absl::Now());
      housekeeping_mu_.Lock();
    }
  });
}

MoeServiceImpl::~MoeServiceImpl() {
  step_channels_.reset();   // first: their threads wait on handlers_
  stopping_drains_ = true;  // drains end; handlers_ (destroyed last) joins them
  {
    absl::MutexLock lock(&housekeeping_mu_);
    stopping_ = true;
  }
  if (housekeeping_.joinable()) housekeeping_.join();
}

grpc::Status MoeServiceImpl::Finish(const char* method, absl::Time start,
                                    const absl::Status& status) {
  if (metrics_ != nullptr) {
    metrics_->CountRequest(method, static_cast<int>(status.code()),
                           absl::ToDoubleSeconds(absl::Now() - start));
  }
  return ToGrpcStatus(status);
}

absl::StatusOr<std::shared_ptr<MoeServiceImpl::Layer>> MoeServiceImpl::FindLayer(
    const std::string& name) const {
  return layers_.Find(name);
}

void MoeServiceImpl::VisitHeldLayers(const WorkerMemoryAdmission::LayerVisitor& visit) const {
  const std::vector<std::shared_ptr<Layer>> layers = layers_.List();
  for (const auto& layer : layers) visit(layer->config, SavedBytes(*layer));
}

absl::StatusOr<std::unique_ptr<MoeServiceImpl::Turn>> MoeServiceImpl::TakeTurn(
    const std::string& name, grpc::ServerContextBase* context, bool require_serving,
    bool allow_diverged) {
  ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer, FindLayer(name));
  return TakeTurn(std::move(layer), context, require_serving, allow_diverged);
}

absl::StatusOr<std::unique_ptr<MoeServiceImpl::Turn>> MoeServiceImpl::TakeTurn(
    std::shared_ptr<Layer> layer, grpc::ServerContextBase* context, bool require_serving,
    bool allow_diverged) {
  return TakeTurnUntil(
      std::move(layer), absl::FromChrono(context->deadline()),
      [context] { return context->IsCancelled(); }, require_serving, allow_diverged);
}

absl::StatusOr<std::unique_ptr<MoeServiceImpl::Turn>> MoeServiceImpl::TakeTurn(
    std::shared_ptr<Layer> layer, const StepCaller& caller, bool require_serving,
    bool allow_diverged) {
  return TakeTurnUntil(
      std::move(layer), caller.deadline(), [&caller] { return caller.cancelled(); },
      require_serving, allow_diverged);
}

absl::StatusOr<std::unique_ptr<MoeServiceImpl::Turn>> MoeServiceImpl::TakeTurnUntil(
    std::shared_ptr<Layer> layer, absl::Time deadline, const std::function<bool()>& cancelled,
    bool require_serving, bool allow_diverged) {
  const std::string& name = layer->name;
  if (!layer->turn.Lock(deadline, cancelled)) {
    if (cancelled && cancelled()) return absl::CancelledError("client cancelled");
    return absl::DeadlineExceededError(
        absl::StrCat("deadline passed while waiting for layer \"", name, "\""));
  }
  auto turn = std::make_unique<Turn>(layer, this);
  setup_mu_.ReaderLock();
  turn->set_shared();
  {
    absl::MutexLock lock(&layer->mu);
    if (layer->deleted) {
      return absl::NotFoundError(absl::StrCat("layer: \"", name, "\" was deleted"));
    }
    if (layer->closed) return absl::UnavailableError(kShuttingDownMessage);
    if (!layer->diverged.empty() && !allow_diverged) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer \"", name, "\": its workers may hold different state (", layer->diverged, "); ",
          layer->diverged_gradients_only
              ? "ZeroGradients makes them agree again"
              : "LoadCheckpoint, or SetWeights of every parameter (the optimizer state then "
                "starts again from zero), makes them agree again (or DeleteLayer, then "
                "CreateLayer)"));
    }
  }
  absl::StatusOr<WorkerSet> set = pool_->Serving();
  if (set.ok()) {
    turn->set = std::move(*set);
  } else if (require_serving) {
    return set.status();
  }
  return turn;
}

absl::Status MoeServiceImpl::ChangeOnWorkers(Turn& turn, const char* method, absl::Time deadline,
                                             const WorkerPool::WorkerFn& fn, bool collective,
                                             bool gradients_only, bool idempotent) {
  bool partial = false;
  absl::Status status = FanOutOnLayer(turn, deadline, fn, collective, 0, &partial);
  if (status.ok() || !partial) return status;
  // The retry has what is left of the call's deadline, not a deadline of its own: the caller
  // hears within --step_timeout_ms (a call that ran to its deadline is not retried).
  if (idempotent && absl::Now() < deadline) {
    absl::StatusOr<WorkerSet> set = pool_->Serving();
    if (set.ok() && set->generation == turn.set.generation) {
      std::fprintf(stderr, "moed: layer %s: %s failed on some workers (%s); retrying it\n",
                   turn.layer().name.c_str(), method, std::string(status.message()).c_str());
      bool retry_partial = false;
      absl::Status retried = FanOutOnLayer(turn, deadline, fn, collective, 0, &retry_partial);
      if (retried.ok()) return retried;
      status = retried;
    }
  }
  Layer& layer = turn.layer();
  absl::MutexLock lock(&layer.mu);
  // A second failure never narrows what may differ.
  layer.diverged_gradients_only =
      gradients_only && (layer.diverged.empty() || layer.diverged_gradients_only);
  layer.diverged = absl::StrCat(method,
                                " failed on some workers and may have taken effect on "
                                "others: ",
                                status.message());
  std::fprintf(stderr, "moed: layer %s diverged: %s\n", layer.name.c_str(), layer.diverged.c_str());
  return status;
}

absl::Time MoeServiceImpl::InternalDeadline(grpc::ServerContextBase* context,
                                            bool collective) const {
  return InternalDeadline(absl::FromChrono(context->deadline()), collective);
}

absl::Time MoeServiceImpl::InternalDeadline(absl::Time caller_deadline, bool collective) const {
  absl::Time deadline = absl::Now() + options_.step_timeout;
  if (!collective) deadline = std::min(deadline, caller_deadline);
  return deadline;
}

SavedStepLimits MoeServiceImpl::SavedLimits() const {
  SavedStepLimits limits;
  limits.max_steps = options_.max_saved_steps;
  limits.max_bytes = options_.max_saved_bytes;
  limits.ttl = options_.saved_step_ttl;
  return limits;
}

v1::LayerInfo MoeServiceImpl::Info(const Layer& layer) const {
  v1::LayerInfo info;
  info.set_name(layer.name);
  *info.mutable_config() = ConfigToProto(layer.config);
  info.set_ep_ranks(pool_->world_size());
  for (const ParameterLayout& p : LayerParameters(layer.config)) {
    v1::ParameterInfo* param = info.add_parameters();
    param->set_name(p.name);
    for (int64_t d : p.shape) param->add_shape(d);
  }
  absl::MutexLock lock(&layer.mu);
  info.set_saved_steps(layer.saved.count());
  info.set_saved_bytes(layer.saved.bytes());
  info.set_forward_count(layer.forward_count);
  info.set_weights_reset(layer.weights_reset);
  info.set_diverged(layer.diverged);
  info.set_optimizer_step(layer.optimizer_step);
  info.set_fp8_gemms(layer.fp8_gemms);
  if (options_.durable_store != nullptr) {
    info.set_durable(true);
    info.set_durable_optimizer_step(layer.durable.optimizer_step);
    if (!layer.durable.checkpoint.empty()) {
      info.set_durable_checkpoint_unix_ms(absl::ToUnixMillis(layer.durable.saved_at));
    }
    info.set_durable_error(layer.durable_error);
  }
  *info.mutable_accumulated_load() = ComputeLoad(layer.accumulated);
  return info;
}

namespace {

// Memory estimate: ValidateConfig's bounds keep each parameter's element count well inside
// int64; the sum and the bytes are taken in floating point.
absl::Status CheckLayerBytes(const LayerConfig& config, int64_t max_layer_bytes) {
  long double elements = 0;
  for (const ParameterLayout& p : LayerParameters(config)) {
    elements += static_cast<long double>(NumElements(p.shape));
  }
  const long double bytes = elements * 4 * sizeof(float);
  if (bytes > static_cast<long double>(max_layer_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "config: parameters, gradients and optimizer state need ~", static_cast<double>(bytes),
        " bytes, more than --max_layer_bytes=", max_layer_bytes));
  }
  return absl::OkStatus();
}

// LayerInfo.fp8_gemms from the workers' answers (one per rank): their common set, or each
// rank's when they differ (workers on different kinds of device).
std::string AgreedFp8Gemms(const std::vector<std::string>& per_rank) {
  if (per_rank.empty() ||
      std::all_of(per_rank.begin(), per_rank.end(),
                  [&](const std::string& s) { return s == per_rank[0]; })) {
    return per_rank.empty() ? "" : per_rank[0];
  }
  std::vector<std::string> items;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    items.push_back(absl::StrCat("rank ", r, ": ", per_rank[r]));
  }
  return absl::StrJoin(items, "; ");
}

}  // namespace

absl::Status MoeServiceImpl::CreateOnWorkers(grpc::ServerContextBase* context,
                                             const std::shared_ptr<Layer>& layer) {
  ASSIGN_OR_RETURN(WorkerSet set, pool_->Serving());
  internal::WorkerCreateLayerRequest create;
  create.set_generation(set.generation);
  create.set_layer_id(layer->id);
  create.set_name(layer->name);
  *create.mutable_config() = ConfigToProto(layer->config);
  // The client's deadline and cancellation reach the workers, which stop initialising
  // within about a second (engine/moe_layer.h, Create's `cancelled`). A failure re-forms
  // nothing: the new layer has a communicator of its own, used by nothing else, and the
  // workers that created it drop it below.
  FanOutOptions options;
  options.cancelled = [context] { return context->IsCancelled(); };
  FanOutOutcome outcome;
  std::vector<std::string> fp8_gemms(pool_->world_size());  // each rank writes its own
  absl::Status created = pool_->ForEachWorker(
      set, InternalDeadline(context, false),
      [&](int rank, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
        internal::WorkerCreateLayerResponse created;
        grpc::Status status = stub->CreateLayer(ctx, create, &created);
        if (rank >= 0 && rank < static_cast<int>(fp8_gemms.size())) {
          if (rank >= 0 && rank < static_cast<int>(fp8_gemms.size())) {
            fp8_gemms[rank] = created.fp8_gemms();
          }
        }
        return FromGrpcStatus(status);
      },
      options, &outcome);
  if (!created.ok() && outcome.partial) DropOnWorkers(set, layer->id);
  if (created.ok()) {
    absl::MutexLock lock(&layer->mu);
    layer->fp8_gemms = AgreedFp8Gemms(fp8_gemms);
  }
  if (!created.ok() || options_.durable_store == nullptr) return created;
  return RegisterDurable(set, layer);
}

absl::Status MoeServiceImpl::RegisterDurable(const WorkerSet& set,
                                             const std::shared_ptr<Layer>& layer) {
  // Registered before the answer: an acknowledged layer survives a restart.
  absl::StatusOr<DurableLayer> record =
      options_.durable_store->AddLayer(layer->name, layer->config);
  if (!record.ok()) {
    DropOnWorkers(set, layer->id);
    return absl::Status(record.status().code(),
                        absl::StrCat("durable state (--state_dir): ", record.status().message()));
  }
  {
    absl::MutexLock lock(&layer->mu);
    layer->durable = *record;
    layer->durable_since = absl::Now();
  }
  // A DeleteLayer that took the layer off the books before the record was set found
  // nothing to remove from the store: remove it here (set first, checked second, so one
  // of the two always does).
  if (!layers_.Lists(layer)) options_.durable_store->RemoveLayer(*record).IgnoreError();
  return absl::OkStatus();
}

void MoeServiceImpl::UnlistFailedLayer(const std::shared_ptr<Layer>& layer) {
  // Only this layer: a DeleteLayer may have removed it meanwhile and a CreateLayer made
  // another under the same name. Its turn is still held: no call sees it before `deleted`.
  layers_.Remove(layer).IgnoreError();
  absl::MutexLock layer_lock(&layer->mu);
  layer->deleted = true;
}

grpc::Status MoeServiceImpl::DoCreateLayer(grpc::ServerContextBase* context,
                                           const v1::CreateLayerRequest* request,
                                           v1::CreateLayerResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "CreateLayer");
  auto run = [&]() -> absl::Status {
    RETURN_IF_ERROR(ValidateLayerName("name", request->name()));
    if (!request->has_config()) return absl::InvalidArgumentError("config: required");
    ASSIGN_OR_RETURN(LayerConfig config, ConfigFromProto(request->config()));
    RETURN_IF_ERROR(ValidateConfig(config, pool_->world_size()));  // "config.<field>: ..."
    RETURN_IF_ERROR(CheckLayerBytes(config, options_.max_layer_bytes));
    // Its turn is immediate: checked with the calls running now, and its shard reserved until
    // the layer is listed (from then on admission_ counts it).
    WorkerMemoryReservations::Reservation reserved;
    RETURN_IF_ERROR(admission_.Admit(
        "CreateLayer", request->name(), -1,
        LayerBytesPerWorker(config, pool_->world_size(), admission_.DeferredWgradFraction()),
        &reserved));
    auto layer = std::make_shared<Layer>(request->name(), SavedLimits());
    layer->id = layers_.NextLayerId();
    layer->config = config;
    layer->accumulated.assign(config.num_experts, 0);
    // The layer's turn and setup_mu_ (shared) are taken before the layer becomes visible:
    // a request that finds it queues behind its creation, and a re-formation cannot list it
    // before the workers were asked to create it. The turn of a new layer is immediate.
    layer->turn.Lock(absl::InfiniteFuture(), nullptr);
    Turn turn(layer, this);
    setup_mu_.ReaderLock();
    turn.set_shared();
    // ALREADY_EXISTS, or RESOURCE_EXHAUSTED past --max_layers.
    RETURN_IF_ERROR(layers_.Add(layer));
    reserved.Release();  // listed first, then released: never uncounted
    absl::Status status = CreateOnWorkers(context, layer);
    if (!status.ok()) {
      UnlistFailedLayer(layer);
      return status;
    }
    *response->mutable_layer() = Info(*layer);
    return absl::OkStatus();
  };
  return Finish("CreateLayer", start, run());
}

grpc::Status MoeServiceImpl::DoDeleteLayer(grpc::ServerContextBase* context,
                                           const v1::DeleteLayerRequest* request,
                                           v1::DeleteLayerResponse*) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "DeleteLayer");
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer, FindLayer(request->name()));
    // Off the books at once, but the workers hold it until its running step ended and they
    // dropped it: reserved until then (admission control, server/worker_memory_admission.h),
    // taken before it leaves the books so that it is never uncounted.
    const WorkerMemoryReservations::Reservation leaving =
        admission_.HoldLeavingLayer(layer->config, SavedBytes(*layer));
    // The layer leaves the books even when the workers are unreachable: a new generation
    // re-creates only the layers still listed.
    RETURN_IF_ERROR(layers_.Remove(layer));  // NOT_FOUND when deleted meanwhile
    layer->dp_steps.AbortAll(absl::NotFoundError(absl::StrCat(
        "layer: \"", layer->name, "\" was deleted while this step waited for its ranks")));
    // Out of the durable registry at once, so a restart does not bring it back. A durable
    // checkpoint of it still running fails to commit (the store no longer has it).
    absl::Status forgotten = absl::OkStatus();
    if (options_.durable_store != nullptr) {
      DurableLayer record;
      {
        absl::MutexLock lock(&layer->mu);
        record = layer->durable;
      }
      forgotten = options_.durable_store->RemoveLayer(record);
      if (absl::IsNotFound(forgotten)) forgotten = absl::OkStatus();
      if (!forgotten.ok()) {
        forgotten = absl::Status(
            forgotten.code(),
            absl::StrCat("layer \"", layer->name,
                         "\" is deleted, but its durable state could not be removed (a restart "
                         "would restore it): ",
                         forgotten.message()));
      }
    }
    if (!layer->turn.Lock(absl::Now() + options_.step_timeout, nullptr)) {
      // Requests still queued for the layer must not run on it: they get NOT_FOUND. The
      // workers keep its memory until their next generation drops it.
      {
        absl::MutexLock lock(&layer->mu);
        layer->deleted = true;
      }
      if (metrics_ != nullptr) metrics_->DropLayer(layer->name);
      return absl::DeadlineExceededError(absl::StrCat(
          "layer \"", layer->name,
          "\" is deleted (further requests get NOT_FOUND), but a step held it past "
          "--step_timeout_ms; the workers free its memory at their next re-formation"));
    }
    Turn turn(layer, this);
    setup_mu_.ReaderLock();
    turn.set_shared();
    {
      absl::MutexLock lock(&layer->mu);
      layer->deleted = true;
    }
    // Under the turn: no step of this layer counts tokens after this.
    if (metrics_ != nullptr) metrics_->DropLayer(layer->name);
    absl::StatusOr<WorkerSet> set = pool_->Serving();
    if (!set.ok()) return forgotten;
    DropOnWorkers(*set, layer->id);
    return forgotten;
  };
  return Finish("DeleteLayer", start, run());
}

void MoeServiceImpl::DropOnWorkers(const WorkerSet& set, uint64_t layer_id) {
  internal::WorkerLayerRequest del;
  del.set_generation(set.generation);
  del.set_layer_id(layer_id);
  // Best effort: a worker that misses it drops the layer at the next generation.
  pool_
      ->ForEachWorker(
          set, absl::Now() + options_.step_timeout,
          [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
            internal::WorkerEmpty empty;
            return FromGrpcStatus(stub->DeleteLayer(ctx, del, &empty));
          },
          /*collective=*/false)
      .IgnoreError();
}

grpc::Status MoeServiceImpl::DoListLayers(grpc::ServerContextBase*, const v1::ListLayersRequest*,
                                          v1::ListLayersResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "ListLayers");
  const std::vector<std::shared_ptr<Layer>> layers = layers_.List();
  for (const auto& layer : layers) *response->add_layers() = Info(*layer);
  return Finish("ListLayers", start, absl::OkStatus());
}

grpc::Status MoeServiceImpl::DoGetLayer(grpc::ServerContextBase*,
                                        const v1::GetLayerRequest* request,
                                        v1::GetLayerResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "GetLayer");
  absl::StatusOr<std::shared_ptr<Layer>> layer = FindLayer(request->name());
  if (layer.ok()) *response->mutable_layer() = Info(**layer);
  return Finish("GetLayer", start, layer.status());
}

grpc::Status MoeServiceImpl::DoGetStatus(grpc::ServerContextBase*, const v1::GetStatusRequest*,
                                         v1::GetStatusResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "GetStatus");
  response->set_serving(pool_->serving());
  response->set_generation(pool_->generation());
  response->set_world_size(pool_->world_size());
  response->set_message(pool_->message());
  for (const v1::WorkerStatus& worker : pool_->WorkerStatuses()) *response->add_workers() = worker;
  const std::vector<std::shared_ptr<Layer>> layers = layers_.List();
  for (const auto& layer : layers) *response->add_layers() = Info(*layer);
  return Finish("GetStatus", start, absl::OkStatus());
}

bool MoeServiceImpl::KeepsWeights(Layer& layer, bool on_every_worker, bool* durable) const {
  absl::MutexLock lock(&layer.mu);
  *durable = options_.durable_store != nullptr && layer.durable.incarnation != 0;
  if (!on_every_worker || layer.load_durable) return false;
  // A durable layer whose workers may hold different parameters (a worker lost in the middle
  // of a change, then back as the same process) is repaired from its durable state: keeping
  // its weights would keep the mix (issue 14: "diverged" is repaired automatically).
  return !(*durable && !layer.diverged.empty() && !layer.diverged_gradients_only);
}

absl::Status MoeServiceImpl::RecreateLayers(const WorkerSet& set) {
  absl::WriterMutexLock setup_lock(&setup_mu_);
  const std::vector<std::shared_ptr<Layer>> layers = layers_.List();
  // Which layers can every worker restore from an earlier generation?
  std::vector<std::set<uint64_t>> restorable(set.size());
  RETURN_IF_ERROR(pool_->ForEachWorker(
      set, absl::Now() + options_.step_timeout,
      [&](int r, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
        internal::PingRequest ping;
        internal::PingResponse pong;
        absl::Status status = FromGrpcStatus(stub->Ping(ctx, ping, &pong));
        restorable[r].insert(pong.restorable_layers().begin(), pong.restorable_layers().end());
        return status;
      },
      /*collective=*/false));
  // The workers keep a retired layer until it is re-created or deleted: drop the ones deleted
  // here meanwhile (DeleteLayer while the workers were not serving). Best effort.
  std::set<uint64_t> known;
  for (const auto& layer : layers) known.insert(layer->id);
  pool_
      ->ForEachWorker(
          set, absl::Now() + options_.step_timeout,
          [&](int r, internal::Worker::Stub* stub, grpc::ClientContext* call) -> absl::Status {
            for (uint64_t id : restorable[r]) {
              if (known.count(id) != 0) continue;
              grpc::ClientContext ctx;  // one per call, all within the fan-out's deadline
              ctx.set_deadline(call->deadline());
              internal::WorkerLayerRequest del;
              del.set_generation(set.generation);
              del.set_layer_id(id);
              internal::WorkerEmpty empty;
              RETURN_IF_ERROR(FromGrpcStatus(stub->DeleteLayer(&ctx, del, &empty)));
            }
            return absl::OkStatus();
          },
          /*collective=*/false)
      .IgnoreError();
  for (const auto& layer : layers) {
    bool on_every_worker = true;
    for (const auto& ids : restorable) on_every_worker = on_every_worker && ids.count(layer->id);
    bool durable = false;
    const bool restore = KeepsWeights(*layer, on_every_worker, &durable);
    internal::WorkerCreateLayerRequest create;
    create.set_generation(set.generation);
    create.set_layer_id(layer->id);
    create.set_name(layer->name);
    create.set_restore(restore);
    *create.mutable_config() = ConfigToProto(layer->config);
    std::vector<std::string> fp8_gemms(pool_->world_size());  // each rank writes its own
    RETURN_IF_ERROR(pool_->ForEachWorker(
        set, absl::Now() + options_.step_timeout,
        [&](int rank, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
          internal::WorkerCreateLayerResponse created;
          grpc::Status status = stub->CreateLayer(ctx, create, &created);
          if (rank >= 0 && rank < static_cast<int>(fp8_gemms.size())) {
          if (rank >= 0 && rank < static_cast<int>(fp8_gemms.size())) {
            fp8_gemms[rank] = created.fp8_gemms();
          }
        }
          return FromGrpcStatus(status);
        },
        /*collective=*/false));
    {
      absl::MutexLock lock(&layer->mu);
      layer->fp8_gemms = AgreedFp8Gemms(fp8_gemms);
    }
    // A durable layer the workers lost reloads its latest durable checkpoint. A failure
    // leaves it at init_seed (weights_reset, durable_error) and the next generation retries.
    absl::Status reloaded = absl::OkStatus();
    if (!restore && durable) {
      {
        absl::MutexLock lock(&layer->mu);
        layer->load_durable = true;
      }
      reloaded = LoadDurable(set, *layer);
    }
    std::fprintf(stderr, "moed: generation %lld: layer %s re-created (%s)\n",
                 static_cast<long long>(set.generation), layer->name.c_str(),
                 restore    ? "weights kept"
                 : !durable ? "weights from init_seed; load a checkpoint"
                 : reloaded.ok()
                     ? "durable state reloaded"
                     : absl::StrCat("durable state NOT reloaded: ", reloaded.message()).c_str());
    absl::MutexLock lock(&layer->mu);
    layer->saved.Clear();
    layer->accumulated.assign(layer->config.num_experts, 0);
    layer->gradients_dropped = true;
    if (!reloaded.ok()) layer->durable_error = std::string(reloaded.message());
    if (!restore && (!durable || !reloaded.ok())) layer->weights_reset = true;
    if (!restore && durable && reloaded.ok()) layer->weights_reset = false;
    // From init_seed, or kept with the gradients dropped: what a gradients-only failure left
    // different is gone; parameters or optimizer state kept from divergent workers are not.
    if (!restore || layer->diverged_gradients_only) layer->ClearDiverged();
  }
  return absl::OkStatus();
}

void MoeServiceImpl::ExpireSavedSteps() {
  const absl::Time now = absl::Now();
  const std::vector<std::shared_ptr<Layer>> layers = layers_.List();
  for (const auto& layer : layers) {
    auto any_due = [&] {
      absl::MutexLock lock(&layer->mu);
      return layer->saved.AnyDue(now);
    };
    if (!any_due()) continue;
    // The step's turn, as ReleaseStep: a step being used by a queued Backward is not pulled
    // away under it. Waiting is bounded; a busy layer is retried next round. A re-formation
    // (setup_mu_ held exclusively) drops saved steps itself.
    if (!layer->turn.Lock(absl::Now() + absl::Milliseconds(200), nullptr)) continue;
    Turn turn(layer, this);
    if (!setup_mu_.ReaderTryLock()) continue;
    turn.set_shared();
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&layer->mu);
      if (layer->deleted) continue;
      ids = layer->saved.Expire(now);
    }
    if (ids.empty()) continue;
    std::fprintf(stderr, "moed: layer %s: %zu saved step(s) expired (--saved_step_ttl_s)\n",
                 layer->name.c_str(), ids.size());
    if (metrics_ != nullptr) metrics_->CountSavedSteps("expired", static_cast<int64_t>(ids.size()));
    absl::StatusOr<WorkerSet> set = pool_->Serving();
    if (set.ok()) ReleaseOnWorkers(*set, *layer, ids);
  }
}

std::vector<MetricsSnapshot::Layer> MoeServiceImpl::LayerMetrics() const {
  std::vector<MetricsSnapshot::Layer> layers;
  layers_.ForEach([&layers](Layer& layer) {
    absl::MutexLock layer_lock(&layer.mu);
    layers.push_back({layer.name, layer.saved.count(), layer.saved.bytes()});
  });
  return layers;
}

}  // namespace moe
