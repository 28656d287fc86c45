// moed's public service (moe.v1.MoeService, proto/moe.proto): validates every request before
// any worker sees it, serialises each layer's steps in arrival order, splits batches into
// contiguous per-worker token slices, fans calls out through the WorkerPool and gathers the
// answers. It owns no model tensors; it remembers each layer's config (to re-create layers
// when the workers form a new generation) and its saved steps' books (server/saved_steps.h).
//
// Locking order: setup_mu_ (shared by operations, exclusive while layers are re-created for
// a new generation) is taken after a layer's FIFO turn and before the admission control's
// admission_'s reservations (server/worker_memory_admission.h), which come before the layer
// registry's lock (layers_, server/layer_registry.h) / a layer's mu.
// Collective worker calls (CreateLayer, Forward, Backward) run under the layer's FIFO turn
// with the internal deadline --step_timeout_ms; the client's deadline and cancellation are
// honoured while waiting for the turn, and a started step is finished (aborting it on one
// rank would leave the others in a collective) but its answer dropped if the client left.
// A call that passes its internal deadline fails alone (DEADLINE_EXCEEDED): the workers
// finish it, and its layer's turn is held until they did (FanOutOnLayer); no re-formation.
//
//   MoeServiceImpl service(options, &pool, &metrics);
//   pool.set_on_setup([&](const WorkerSet& set) { return service.RecreateLayers(set); });
//   builder.RegisterService(&service);
#ifndef MOED_SERVER_MOE_SERVICE_H_
#define MOED_SERVER_MOE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/config.h"
#include "engine/dtype.h"
#include "engine/tensor.h"
#include "proto/moe.grpc.pb.h"
#include "proto/tensor_wire.h"
#include "server/auth.h"
#include "server/callback.h"
#include "server/checkpoint_root.h"
#include "server/data_parallel_steps.h"
#include "server/durable_schedule.h"
#include "server/durable_store.h"
#include "server/forward_batcher.h"
#include "server/graceful_stop.h"
#include "server/layer_registry.h"
#include "server/metrics.h"
#include "server/relay_pool.h"
#include "server/saved_steps.h"
#include "server/shared_memory.h"
#include "server/shm_step.h"
#include "server/staging.h"
#include "server/step_caller.h"
#include "server/step_channels.h"
#include "server/worker_memory_admission.h"
#include "server/worker_memory_reservations.h"
#include "server/worker_pool.h"

namespace moe {

struct ServiceOptions {
  int64_t max_saved_steps = 64;                // per layer
  int64_t max_saved_bytes = int64_t{8} << 30;  // per layer, summed over workers
  absl::Duration step_timeout = absl::Seconds(30);
  int64_t max_message_bytes = int64_t{256} << 20;  // public messages, both directions
  // A layer whose parameters, gradients and two optimizer states (4 x fp32 per parameter,
  // summed over all workers) would exceed this is refused at CreateLayer.
  int64_t max_layer_bytes = int64_t{1} << 40;
  // Layers that may exist at once; a CreateLayer beyond it is RESOURCE_EXHAUSTED. Every layer
  // costs each worker its own communicator (sockets to every peer) and a share of the pings.
  int64_t max_layers = 1024;
  // Admission control (server/step_memory.h): the memory one worker may hold for its layers
  // (LayerBytesPerWorker), the steps kept for backward and the estimates of the steps running
  // at once, on any layer (ForwardStepBytes / BackwardStepBytes, reserved while they run). A
  // CreateLayer, Forward or Backward that would pass it is RESOURCE_EXHAUSTED naming
  // --worker_memory_bytes before any worker is called.
  // 0: derived from the workers' reported memory (WorkerMemoryAdmission::Budget); -1: off.
  int64_t worker_memory_bytes = 0;
  // A saved step not used by Backward within this long is released on the workers (a client
  // that died must not hold the layer's budget); a later Backward on it is
  // FAILED_PRECONDITION saying it expired. Zero: never.
  absl::Duration saved_step_ttl = absl::Seconds(600);
  // Calls whose bodies may run at once (each waits on its own thread for a layer's turn and
  // for the workers); a call beyond it is RESOURCE_EXHAUSTED.
  int handler_threads = 1024;
  // Calls of one client (its token's hash with a tokens file, else its address) whose bodies
  // may run at once; beyond it that client's call is RESOURCE_EXHAUSTED naming
  // --handler_threads_per_client. Zero: no per-client limit.
  int handler_threads_per_client = 0;
  // Tensors that ForwardStream / BackwardStream steps of all clients assemble in moed at once,
  // counted by the size their first message announces (shape x datatype) before any piece is
  // read; a step that would pass it while others hold something is RESOURCE_EXHAUSTED naming
  // --max_inflight_bytes (one alone is always admitted: max_stream_bytes bounds it).
  int64_t max_inflight_bytes = int64_t{4} << 30;
  // Whole-layer tensors that weight streams of all clients hold in moed at once: GetWeights /
  // GetGradients gather theirs from the workers, SetWeights assembles what the client sends;
  // released when the stream ends. A stream that would pass it while others hold something is
  // RESOURCE_EXHAUSTED; one alone is always served.
  int64_t max_stream_bytes = int64_t{16} << 30;
  // A weight stream whose client has not taken the next message (GetWeights, GetGradients) or
  // sent it (SetWeights) within this long is cancelled: its handler thread and the bytes it
  // holds of max_stream_bytes are free again.
  absl::Duration stream_idle_timeout = absl::Seconds(60);
  // Where SaveCheckpoint / LoadCheckpoint read and write (server/checkpoint_root.h); owned by
  // the caller, outlives the service. Null: the checkpoint RPCs are FAILED_PRECONDITION.
  CheckpointRoot* checkpoint_root = nullptr;
  // Bearer tokens and roles of the public API (server/auth.h); owned by the caller. Null: no
  // tokens file, every call is allowed.
  const TokenAuthenticator* auth = nullptr;
  // Client shared-memory regions (RegisterSystemSharedMemory): refused (UNIMPLEMENTED) unless
  // set. A region no step used for shm_idle_timeout is unregistered (zero: never).
  bool allow_client_shm = false;
  absl::Duration shm_idle_timeout = absl::Seconds(600);
  // Steps whose tensors arrive over gRPC reach workers on this host through moed's shared-
  // memory relay buffers (server/relay_pool.h) instead of a second gRPC hop, using at most
  // shm_relay_max_bytes of /dev/shm (past it, or with shm_relay off: over gRPC).
  bool shm_relay = true;
  int64_t shm_relay_max_bytes = int64_t{2} << 30;
  // Staged tensors (StageTensor / FetchStaged, in the relay buffers; off without shm_relay)
  // unused for this long are dropped.
  absl::Duration staged_ttl = absl::Seconds(60);
  // A call that passed its internal deadline (step_timeout) on live workers keeps its layer's
  // turn until they finished it; one still running after this long means a wedged worker:
  // the workers re-form.
  absl::Duration overdue_call_limit = absl::Minutes(10);
  // A data-parallel ApplyOptimizer step (num_ranks > 1) whose ranks have not all called this
  // long after its first call is dropped; its waiting calls are ABORTED
  // (server/data_parallel_steps.h).
  absl::Duration dp_step_timeout = absl::Minutes(5);
  // The largest num_ranks a data-parallel step may declare (2 to kMaxDataParallelRanks);
  // more is INVALID_ARGUMENT.
  int max_dp_ranks = 1024;
  // Durable layers (moed --state_dir; server/durable_store.h), owned by the caller. Null: no
  // durable state (a restart loses every layer). A layer's state is checkpointed into it after
  // every `durable_every_steps` optimizer steps, and once `durable_every` passed since its last
  // checkpoint with something changed, at its next ApplyOptimizer or UpdateExpertBias (zero:
  // that trigger is off); and after every SetWeights and LoadCheckpoint.
  DurableStore* durable_store = nullptr;
  int64_t durable_every_steps = 100;
  absl::Duration durable_every = absl::Minutes(5);
  // Step channels (OpenStepChannel; server/step_channels.h), with allow_client_shm only:
  // open at once (all clients; per client, 0: no per-client bound) and the largest ring.
  int max_step_channels = 64;
  int max_step_channels_per_client = 8;
  uint64_t max_step_channel_bytes = uint64_t{64} << 20;
  // A channel's thread spins up to this long for the next record before it sleeps
  // (--ring_spin_us, server/ring_spin.h; zero: no spin).
  absl::Duration step_channel_spin = absl::ZeroDuration();
  // Forwards of several callers on one layer merged into one step (server/forward_batcher.h,
  // moe_service_batching.cc; --forward_batching*).
  ForwardBatchingOptions forward_batching;
};

// Forward and Backward are registered raw (grpc::ByteBuffer in and out): moed splits the
// request around its tensor, hands each worker references to its rows of the received
// bytes, and answers with references to the workers' received output bytes
// (proto/tensor_wire.h): no tensor byte is copied, parsed or serialised in moed.
// StageTensor and FetchStaged are raw for the same reason: a part's rows are copied once,
// into the staging buffer, and fetched rows are sent as slices of the kept output.
// ForwardStream and BackwardStream too: each piece is split around its raw_data as it
// arrives, the pieces are joined as references (TensorBytes::Concat), and the answer goes out
// as pieces that reference the workers' output (moe_service_streams.cc).
// A raw bidi stream cannot sit on top of its typed callback method (same parameters, another
// return type), so the service is stacked method by method over the plain Service: every RPC
// of moe.v1.MoeService in proto order, six of them raw. An RPC added to the proto must be
// added here, else it answers UNIMPLEMENTED.
template <typename Base, template <typename> class... Methods>
struct StackedService {
  using type = Base;
};
template <typename Base, template <typename> class First, template <typename> class... Rest>
struct StackedService<Base, First, Rest...> {
  using type = First<typename StackedService<Base, Rest...>::type>;
};
using MoeServiceBase = StackedService<
    v1::MoeService::Service, v1::MoeService::WithCallbackMethod_CreateLayer,
    v1::MoeService::WithCallbackMethod_DeleteLayer, v1::MoeService::WithCallbackMethod_ListLayers,
    v1::MoeService::WithCallbackMethod_GetLayer, v1::MoeService::WithRawCallbackMethod_Forward,
    v1::MoeService::WithRawCallbackMethod_Backward, v1::MoeService::WithCallbackMethod_ReleaseStep,
    v1::MoeService::WithRawCallbackMethod_ForwardStream,
    v1::MoeService::WithRawCallbackMethod_BackwardStream,
    v1::MoeService::WithRawCallbackMethod_StageTensor,
    v1::MoeService::WithRawCallbackMethod_FetchStaged,
    v1::MoeService::WithCallbackMethod_GetGradients,
    v1::MoeService::WithCallbackMethod_ZeroGradients,
    v1::MoeService::WithCallbackMethod_ApplyOptimizer,
    v1::MoeService::WithCallbackMethod_UpdateExpertBias,
    v1::MoeService::WithCallbackMethod_GetWeights, v1::MoeService::WithCallbackMethod_SetWeights,
    v1::MoeService::WithCallbackMethod_SaveCheckpoint,
    v1::MoeService::WithCallbackMethod_LoadCheckpoint,
    v1::MoeService::WithCallbackMethod_GetStatus,
    v1::MoeService::WithCallbackMethod_RegisterSystemSharedMemory,
    v1::MoeService::WithCallbackMethod_SystemSharedMemoryStatus,
    v1::MoeService::WithCallbackMethod_UnregisterSystemSharedMemory,
    v1::MoeService::WithCallbackMethod_RegisterCudaSharedMemory,
    v1::MoeService::WithCallbackMethod_OpenStepChannel,
    v1::MoeService::WithCallbackMethod_CloseStepChannel>::type;

// A raw ForwardStream / BackwardStream: every message a grpc::ByteBuffer.
using RawStepStream = StreamReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;

class MoeServiceImpl final : public MoeServiceBase {
 public:
  // With a saved_step_ttl, starts a housekeeping thread that expires saved steps.
  MoeServiceImpl(ServiceOptions options, WorkerPool* pool, Metrics* metrics);
  ~MoeServiceImpl() override;  // stops the housekeeping thread

  // WorkerPool on_setup hook: creates every known layer on the new generation's workers.
  // A layer every worker still holds from an earlier generation keeps its parameters and
  // optimizer state; otherwise a durable layer reloads its latest durable checkpoint, and any
  // other starts from init_seed (LayerInfo.weights_reset). Saved steps and accumulated load
  // are dropped either way. Instances the workers still hold of layers deleted meanwhile are
  // dropped.
  absl::Status RecreateLayers(const WorkerSet& set);
  // With a durable store: registers every layer it holds (moe_service_durable.cc), to be
  // created and loaded from its durable checkpoint by the first generation's RecreateLayers
  // (before the pool reports SERVING). Call once, before the pool starts. A config that does
  // not fit this world size is FAILED_PRECONDITION naming the layer.
  absl::Status RestoreDurableLayers();
  // The graceful stop (SIGTERM / SIGINT; server/graceful_stop.h, moe_service_stop.cc).
  // BeginShutdown: from now on every call that would take a handler thread is UNAVAILABLE
  // (kShuttingDownMessage); the calls already accepted run on. ListLayers, GetLayer and
  // GetStatus, which only read moed's books, still answer. Every layer is entered in
  // *report as waiting, so that a stop cut short at once still names them.
  void BeginShutdown(GracefulStopReport* report);
  // Then, once: takes every layer's turn, each behind the calls already queued for it (they
  // finish first), closes it (a call that reaches its turn later is UNAVAILABLE) and, when it
  // changed since its durable checkpoint, writes that checkpoint into the durable store.
  // Returns when every layer is done or `deadline` passed while waiting for a turn; a
  // durable write already started runs to its end. Layers in parallel; outcomes in *report.
  void PersistForShutdown(absl::Time deadline, GracefulStopReport* report);
  // The layers' gauges for a metrics scrape (MetricsSnapshot).
  std::vector<MetricsSnapshot::Layer> LayerMetrics() const;
  // The worker memory (bytes per worker) reserved now by admitted calls still running
  // (admission control; the moed_worker_memory_reserved_bytes gauge).
  int64_t ReservedWorkerBytes() const { return admission_.reserved(); }
  // Releases the saved steps older than saved_step_ttl (the housekeeping thread calls it).
  // A layer whose turn is busy for long, or a re-formation in progress, is left for the
  // next round.
  void ExpireSavedSteps();

  // The RPCs of moe.v1.MoeService on gRPC's callback API: each call's body (Do<Method>)
  // runs on a thread of handlers_ (it may wait for a layer's turn and for the workers).
  grpc::ServerUnaryReactor* CreateLayer(grpc::CallbackServerContext*, const v1::CreateLayerRequest*,
                                        v1::CreateLayerResponse*) override;
  grpc::ServerUnaryReactor* DeleteLayer(grpc::CallbackServerContext*, const v1::DeleteLayerRequest*,
                                        v1::DeleteLayerResponse*) override;
  grpc::ServerUnaryReactor* ListLayers(grpc::CallbackServerContext*, const v1::ListLayersRequest*,
                                       v1::ListLayersResponse*) override;
  grpc::ServerUnaryReactor* GetLayer(grpc::CallbackServerContext*, const v1::GetLayerRequest*,
                                     v1::GetLayerResponse*) override;
  // Raw: a moe.v1.ForwardRequest / BackwardRequest in, the Response out.
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext*, const grpc::ByteBuffer*,
                                    grpc::ByteBuffer*) override;
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext*, const grpc::ByteBuffer*,
                                     grpc::ByteBuffer*) override;
  grpc::ServerUnaryReactor* ReleaseStep(grpc::CallbackServerContext*, const v1::ReleaseStepRequest*,
                                        v1::ReleaseStepResponse*) override;
  // Raw: moe.v1.ForwardRequest / BackwardRequest pieces in, Response pieces out.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardStream(
      grpc::CallbackServerContext*) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* BackwardStream(
      grpc::CallbackServerContext*) override;
  grpc::ServerWriteReactor<v1::TensorChunk>* GetGradients(grpc::CallbackServerContext*,
                                                          const v1::GetGradientsRequest*) override;
  grpc::ServerUnaryReactor* ZeroGradients(grpc::CallbackServerContext*,
                                          const v1::ZeroGradientsRequest*,
                                          v1::ZeroGradientsResponse*) override;
  grpc::ServerUnaryReactor* ApplyOptimizer(grpc::CallbackServerContext*,
                                           const v1::ApplyOptimizerRequest*,
                                           v1::ApplyOptimizerResponse*) override;
  grpc::ServerUnaryReactor* UpdateExpertBias(grpc::CallbackServerContext*,
                                             const v1::UpdateExpertBiasRequest*,
                                             v1::UpdateExpertBiasResponse*) override;
  grpc::ServerWriteReactor<v1::TensorChunk>* GetWeights(grpc::CallbackServerContext*,
                                                        const v1::GetWeightsRequest*) override;
  grpc::ServerReadReactor<v1::SetWeightsRequest>* SetWeights(grpc::CallbackServerContext*,
                                                             v1::SetWeightsResponse*) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(grpc::CallbackServerContext*,
                                           const v1::SaveCheckpointRequest*,
                                           v1::SaveCheckpointResponse*) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(grpc::CallbackServerContext*,
                                           const v1::LoadCheckpointRequest*,
                                           v1::LoadCheckpointResponse*) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext*, const v1::GetStatusRequest*,
                                      v1::GetStatusResponse*) override;
  // Shared memory (moe_service_shm.cc).
  grpc::ServerUnaryReactor* RegisterSystemSharedMemory(
      grpc::CallbackServerContext*, const v1::RegisterSystemSharedMemoryRequest*,
      v1::RegisterSystemSharedMemoryResponse*) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext*, const v1::SystemSharedMemoryStatusRequest*,
      v1::SystemSharedMemoryStatusResponse*) override;
  grpc::ServerUnaryReactor* UnregisterSystemSharedMemory(
      grpc::CallbackServerContext*, const v1::UnregisterSystemSharedMemoryRequest*,
      v1::UnregisterSystemSharedMemoryResponse*) override;
  grpc::ServerUnaryReactor* RegisterCudaSharedMemory(
      grpc::CallbackServerContext*, const v1::RegisterCudaSharedMemoryRequest*,
      v1::RegisterCudaSharedMemoryResponse*) override;
  // Step channels (moe_service_channels.cc; proto/moe.proto "Step channels").
  grpc::ServerUnaryReactor* OpenStepChannel(grpc::CallbackServerContext*,
                                            const v1::OpenStepChannelRequest*,
                                            v1::OpenStepChannelResponse*) override;
  grpc::ServerUnaryReactor* CloseStepChannel(grpc::CallbackServerContext*,
                                             const v1::CloseStepChannelRequest*,
                                             v1::CloseStepChannelResponse*) override;
  // After the tokens file was reloaded: closes the step channels whose token is no longer
  // in it (their later records would be UNAUTHENTICATED anyway). Returns how many.
  int CloseRevokedStepChannels();
  // Step channels open now (tests, GetStatus).
  int OpenStepChannels() const { return step_channels_ ? step_channels_->open_count() : 0; }

 private:
  // Step channels (moe_service_channels.cc). Who opened a channel, captured at open: every
  // record is authorized against it (AllowChannel) and runs as its StepCaller.
  struct ChannelIdentity {
    std::string client;      // ClientOf at open: the books' owner, the per-client key
    std::string token_hash;  // TokenAuthenticator::TokenHash (with a tokens file)
    std::string peer;        // the open's peer (checked local)
  };
  grpc::Status DoOpenStepChannel(grpc::ServerContextBase*, const v1::OpenStepChannelRequest*,
                                 v1::OpenStepChannelResponse*);
  grpc::Status DoCloseStepChannel(grpc::ServerContextBase*, const v1::CloseStepChannelRequest*,
                                  v1::CloseStepChannelResponse*);
  // Allow (metrics included) for a channel's identity.
  absl::Status AllowChannel(const ChannelIdentity& who, Role role) const;
  // One record of a channel (moe_service_rpcs.cc, beside RunRawStep): the envelope decoded,
  // the record's role checked, the step run as the gRPC call's body (same code, same bytes)
  // on the channel's own thread in a handlers_ slot (HandlerPool::RunHere: the same limits and
  // refusals), its answer's bytes or its status.
  absl::StatusOr<std::string> AnswerStepRecord(const ChannelIdentity& who,
                                               absl::string_view record,
                                               const StepChannels::Cancelled& cancelled);
  grpc::Status DoCreateLayer(grpc::ServerContextBase*, const v1::CreateLayerRequest*,
                             v1::CreateLayerResponse*);
  grpc::Status DoDeleteLayer(grpc::ServerContextBase*, const v1::DeleteLayerRequest*,
                             v1::DeleteLayerResponse*);
  grpc::Status DoListLayers(grpc::ServerContextBase*, const v1::ListLayersRequest*,
                            v1::ListLayersResponse*);
  grpc::Status DoGetLayer(grpc::ServerContextBase*, const v1::GetLayerRequest*,
                          v1::GetLayerResponse*);
  // A step: `request`'s tensor field (x / d_out) carries datatype and shape, its bytes are
  // `input` (raw_data is not read). The answer's tensor (out / d_x) gets datatype and shape;
  // its bytes are *output, references to the workers' answers in rank order (no copy).
  // `caller`: the gRPC call's (GrpcStepCaller) or a step channel's record's.
  grpc::Status DoForward(const StepCaller& caller, const v1::ForwardRequest& request,
                         const TensorBytes& input, v1::ForwardResponse* response,
                         std::vector<grpc::Slice>* output);
  // A step of several callers' forwards (moe_service_batching.cc): it belongs to none of
  // them (its StepCaller has their latest deadline and is cancelled once every member left);
  // its workers report each token's experts into *routed_experts ([T, k]).
  struct MergedStep {
    std::vector<int32_t>* routed_experts = nullptr;
  };
  // DoForward's step (merged: null for a caller's own forward, which it also counts in
  // metrics; else the merged step, counted by its members).
  grpc::Status RunForwardStep(const StepCaller& caller, const v1::ForwardRequest& request,
                              const TensorBytes& input, v1::ForwardResponse* response,
                              std::vector<grpc::Slice>* output, const MergedStep* merged);
  // moe_service_batching.cc. A forward that may share a step with other callers' (inference,
  // x in the message, a layer whose per-caller results do not depend on the batch) joins the
  // layer's batch and gets its own rows, counts and status: returns its status. Anything else,
  // or a request that would fail alone, returns nullopt: DoForward runs it (and refuses it)
  // by itself, so a bad request never joins a batch.
  std::optional<grpc::Status> ForwardInBatch(const StepCaller& caller,
                                             const v1::ForwardRequest& request,
                                             const TensorBytes& input,
                                             v1::ForwardResponse* response,
                                             std::vector<grpc::Slice>* output);

  grpc::Status DoBackward(const StepCaller& caller, const v1::BackwardRequest& request,
                          const TensorBytes& input, v1::BackwardResponse* response,
                          std::vector<grpc::Slice>* output);
  grpc::Status DoReleaseStep(const StepCaller& caller, const v1::ReleaseStepRequest*,
                             v1::ReleaseStepResponse*);
  // moe_service_streams.cc: assemble the request's tensor (references to the received
  // pieces), DoForward / DoBackward, answer in pieces (references to the workers' output).
  grpc::Status DoForwardStream(grpc::ServerContextBase*, RawStepStream*);
  grpc::Status DoBackwardStream(grpc::ServerContextBase*, RawStepStream*);
  grpc::Status DoGetGradients(grpc::ServerContextBase*, const v1::GetGradientsRequest*,
                              StreamWriter<v1::TensorChunk>*);
  grpc::Status DoZeroGradients(grpc::ServerContextBase*, const v1::ZeroGradientsRequest*,
                               v1::ZeroGradientsResponse*);
  grpc::Status DoApplyOptimizer(grpc::ServerContextBase*, const v1::ApplyOptimizerRequest*,
                                v1::ApplyOptimizerResponse*);
  grpc::Status DoUpdateExpertBias(grpc::ServerContextBase*, const v1::UpdateExpertBiasRequest*,
                                  v1::UpdateExpertBiasResponse*);
  grpc::Status DoGetWeights(grpc::ServerContextBase*, const v1::GetWeightsRequest*,
                            StreamWriter<v1::TensorChunk>*);
  grpc::Status DoSetWeights(grpc::ServerContextBase*, StreamReader<v1::SetWeightsRequest>*,
                            v1::SetWeightsResponse*);
  absl::StatusOr<CheckpointRoot*> Checkpoints() const;
  grpc::Status DoSaveCheckpoint(grpc::ServerContextBase*, const v1::SaveCheckpointRequest*,
                                v1::SaveCheckpointResponse*);
  grpc::Status DoLoadCheckpoint(grpc::ServerContextBase*, const v1::LoadCheckpointRequest*,
                                v1::LoadCheckpointResponse*);
  grpc::Status DoGetStatus(grpc::ServerContextBase*, const v1::GetStatusRequest*,
                           v1::GetStatusResponse*);

  // Shared memory (moe_service_shm.cc). UNIMPLEMENTED without allow_client_shm,
  // PERMISSION_DENIED for a caller not on this host.
  absl::Status CheckShmAllowed(grpc::ServerContextBase* context) const;
  absl::Status CheckShmAllowed(const std::string& peer) const;
  // Whose shared-memory regions a call names: the token's identity with tokens, else one
  // identity ("") for every caller.
  std::string ShmOwnerOf(const grpc::ServerContextBase& context) const;
  std::string ShmOwnerOfClient(const std::string& client) const;  // the same from ClientOf
  // The regions a step names, leased until the ShmStep is destroyed (empty if none).
  absl::StatusOr<ShmStep> PrepareShm(const StepCaller& caller, const v1::ForwardRequest& request,
                                     int64_t hidden);
  absl::StatusOr<ShmStep> PrepareShm(const StepCaller& caller, const v1::BackwardRequest& request,
                                     int64_t hidden);
  // A gRPC step's tensors through the relay buffers (server/relay_pool.h) when `set` runs on
  // this host: the input [tokens, hidden] of in_dtype, unless *shm already reads it from a
  // client region, is copied into one and *shm set to read it there; the output [tokens,
  // hidden] of out_dtype, unless *shm writes it to a client region, is set to be written
  // into another (RelayStep::output; the caller answers with RelaySlice of it). Does nothing
  // when the relay is off, the workers are remote or the pool is full.
  // A staged input (`staged`, non-null) is read in place: no copy.
  struct RelayRequest {
    absl::string_view in_field;           // "x", "d_out"
    const TensorBytes* input = nullptr;   // the request's bytes (unless staged)
    std::shared_ptr<RelayBuffer> staged;  // a staged input
    DType in_dtype = DType::kFloat32;
    absl::string_view out_field;  // "out", "d_x"
    DType out_dtype = DType::kFloat32;
    int64_t tokens = 0;
    int64_t hidden = 0;
  };
  absl::StatusOr<RelayStep> RelayLocally(const WorkerSet& set, const RelayRequest& request,
                                         ShmStep* shm);
  // Staged tensors (moe_service_staging.cc).
  grpc::ServerUnaryReactor* StageTensor(grpc::CallbackServerContext*, const grpc::ByteBuffer*,
                                        grpc::ByteBuffer*) override;
  grpc::ServerUnaryReactor* FetchStaged(grpc::CallbackServerContext*, const grpc::ByteBuffer*,
                                        grpc::ByteBuffer*) override;
  // The step's staged input `name` (x_staged, d_out_staged) of the caller, taken out of the
  // table: a [T, hidden] head and a view of its bytes.
  absl::StatusOr<StagedStepInput> TakeStaged(const std::string& client, const std::string& name,
                                             int64_t hidden);
  // A step's input tensor `source.field` ("x", "d_out") as the step reads it: staged
  // (staged_name non-null: taken out of the caller's book into *staged), in a client region
  // (shm), or in the message (message_head, message_bytes; in_message). head and bytes point at
  // *staged's or the message's (the message's also for a region, whose bytes the step reads
  // there); INVALID_ARGUMENT when no input is given or it is not an activation [T, hidden].
  struct StepInputSource {
    const char* field = "";
    const std::string* staged_name = nullptr;
    bool in_message = false;
    const v1::Tensor* message_head = nullptr;
    const TensorBytes* message_bytes = nullptr;
  };
  struct StepTensor {
    const v1::Tensor* head = nullptr;
    const TensorBytes* bytes = nullptr;
    DType dtype = DType::kFloat32;
    int64_t tokens = 0;
  };
  absl::StatusOr<StepTensor> ResolveStepInput(const std::string& client,
                                              const StepInputSource& source, const ShmStep& shm,
                                              int64_t hidden, StagedStepInput* staged);
  // Checks out_staged / d_x_staged before a step runs (name free, no region output too).
  absl::Status CheckStagedOutput(const std::string& client, absl::string_view field,
                                 const std::string& name, bool has_shm_output);
  // Keeps the step's output (its answer slices, *output, emptied) under `name`.
  absl::Status KeepStagedOutput(const std::string& client, const std::string& name,
                                DType dtype, int64_t tokens, int64_t hidden,
                                std::vector<grpc::Slice>* output);
  grpc::Status DoRegisterSystemSharedMemory(grpc::ServerContextBase*,
                                            const v1::RegisterSystemSharedMemoryRequest*,
                                            v1::RegisterSystemSharedMemoryResponse*);
  grpc::Status DoSystemSharedMemoryStatus(grpc::ServerContextBase*,
                                          const v1::SystemSharedMemoryStatusRequest*,
                                          v1::SystemSharedMemoryStatusResponse*);
  grpc::Status DoUnregisterSystemSharedMemory(grpc::ServerContextBase*,
                                              const v1::UnregisterSystemSharedMemoryRequest*,
                                              v1::UnregisterSystemSharedMemoryResponse*);
  grpc::Status DoRegisterCudaSharedMemory(grpc::ServerContextBase*,
                                          const v1::RegisterCudaSharedMemoryRequest*,
                                          v1::RegisterCudaSharedMemoryResponse*);
  absl::Status ShmStatus(grpc::ServerContextBase* context, const std::string& name,
                         v1::SystemSharedMemoryStatusResponse* response);
  // Tells the workers to unmap the regions and relay buffers no step uses any more (best
  // effort).
  void ForgetRetiredShm();
  // Housekeeping: drops client regions whose object is gone or that stayed idle, then forgets
  // them and the retired relay buffers.
  void HousekeepShm();

  // The front end's record of one layer (server/layer_entry.h), listed in layers_.
  using Layer = LayerEntry;

  // A layer's FIFO turn, setup_mu_ held shared, and the serving workers, for one operation.
  // A turn whose call was overdue on the workers (set_overdue) is not released when the
  // Turn is destroyed: DrainThenRelease keeps it until the workers finished that call.
  class Turn {
   public:
    Turn(std::shared_ptr<Layer> layer, MoeServiceImpl* service)
        : layer_(std::move(layer)), service_(service) {}
    ~Turn() {
      if (shared_) service_->setup_mu_.ReaderUnlock();
      if (overdue_) {
        service_->DrainThenRelease(std::move(layer_), set, overdue_step_, std::move(memory));
      } else {
        memory.Release();  // before the turn: the layer's next step must not count it
        layer_->turn.Unlock();
      }
    }
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    void set_shared() { shared_ = true; }
    // The workers may still run this turn's last call; step_id: the step it may have saved
    // (0: none), released once they finished.
    void set_overdue(uint64_t step_id) {
      overdue_ = true;
      overdue_step_ = step_id;
    }
    Layer& layer() { return *layer_; }
    WorkerSet set;
    // The worker memory this turn's step was admitted with (admission_.Admit), held until the
    // turn ends; for an overdue call, until the workers finished it (DrainThenRelease).
    WorkerMemoryReservations::Reservation memory;

   private:
    std::shared_ptr<Layer> layer_;
    MoeServiceImpl* service_;
    bool shared_ = false;
    bool overdue_ = false;
    uint64_t overdue_step_ = 0;
  };
  // moe_service_batching.cc: the batcher's run: one step for `members` (MergedForwardMember of one layer and dtype),
  // split back into each member's response, output and status.
  void RunMergedForward(const std::shared_ptr<Layer>& layer, DType dtype,
                        const BatchMembers& members);
  absl::StatusOr<std::shared_ptr<Layer>> FindLayer(const std::string& name) const;
  // Waits for the layer's turn (client deadline/cancellation honoured), then takes setup_mu_
  // shared and the serving worker set.
  // Without require_serving, a turn is granted while the workers are down (its set is empty).
  // A diverged layer (LayerInfo.diverged) is FAILED_PRECONDITION unless allow_diverged (the
  // calls that can mend it, or that read nothing of its state).
  absl::StatusOr<std::unique_ptr<Turn>> TakeTurn(const std::string& name,
                                                 grpc::ServerContextBase* context,
                                                 bool require_serving = true,
                                                 bool allow_diverged = false);
  // The same for a layer already found (and the request validated against its config): a
  // layer deleted meanwhile is NOT_FOUND, never another layer created under the same name.
  absl::StatusOr<std::unique_ptr<Turn>> TakeTurn(std::shared_ptr<Layer> layer,
                                                 grpc::ServerContextBase* context,
                                                 bool require_serving = true,
                                                 bool allow_diverged = false);
  absl::StatusOr<std::unique_ptr<Turn>> TakeTurn(std::shared_ptr<Layer> layer,
                                                 const StepCaller& caller,
                                                 bool require_serving = true,
                                                 bool allow_diverged = false);
  // TakeTurn's body: waits for the turn until `deadline` or `cancelled()` (may be null). A
  // layer closed by the graceful stop is UNAVAILABLE (kShuttingDownMessage).
  absl::StatusOr<std::unique_ptr<Turn>> TakeTurnUntil(std::shared_ptr<Layer> layer,
                                                      absl::Time deadline,
                                                      const std::function<bool()>& cancelled,
                                                      bool require_serving, bool allow_diverged);
  // moe_service_stop.cc. PersistForShutdown for one layer: its turn (after the calls queued
  // for it), closed, written into the durable store when changed; the outcome in *report.
  void CloseAndPersist(const std::shared_ptr<Layer>& layer, absl::Time deadline,
                       GracefulStopReport* report);
  // ForEachWorker for a call that changes the layer's state on the workers. A failure that
  // may have taken effect on some workers only marks the layer diverged, naming `method`
  // and the error (gradients_only: the call changes nothing but gradients).
  // With `idempotent` (fn sends an op_id the workers apply at most once: ApplyOptimizer,
  // UpdateExpertBias), such a failure is first retried once on every worker within what is
  // left of `deadline` (none after a call that ran to it: the caller hears by the deadline):
  // the workers that applied it answer without applying it again, the others apply it now
  // (nothing else ran on the layer meanwhile: the turn is held), so the call happens on every
  // worker or, if the retry fails too or there was no time left for one, the layer is
  // diverged.
  absl::Status ChangeOnWorkers(Turn& turn, const char* method, absl::Time deadline,
                               const WorkerPool::WorkerFn& fn, bool collective,
                               bool gradients_only = false, bool idempotent = false);
  // moe_service_overdue.cc. ForEachWorker for a call on the turn's layer: a call that passes
  // `deadline` while the workers still run it is DEADLINE_EXCEEDED to the caller, restarts
  // nothing, and marks the turn overdue (step_id: the step the call may have saved).
  // `partial` as ForEachWorker's.
  absl::Status FanOutOnLayer(Turn& turn, absl::Time deadline, const WorkerPool::WorkerFn& fn,
                             bool collective, uint64_t step_id = 0, bool* partial = nullptr);
  // Keeps the layer's turn (without setup_mu_) and the call's worker memory reservation until
  // every worker of `set` finished the overdue call: a ReleaseStep(step_id) takes the layer's
  // slot on each worker, so it answers only after the call; then releases both. Runs on a
  // handler thread (inline when none is free). Ends early when the workers re-form or the
  // service stops; a call still running after options_.overdue_call_limit means a wedged
  // worker: the pool re-forms.
  void DrainThenRelease(std::shared_ptr<Layer> layer, const WorkerSet& set, uint64_t step_id,
                        WorkerMemoryReservations::Reservation memory);
  void Drain(const std::shared_ptr<Layer>& layer, const WorkerSet& set, uint64_t step_id);
  // ApplyOptimizer, validated: one optimizer step on the layer's workers, with the gradients
  // times grad_scale.
  absl::Status ApplyOptimizerNow(grpc::ServerContextBase* context, std::shared_ptr<Layer> layer,
                                 const v1::ApplyOptimizerRequest& request, double grad_scale,
                                 v1::ApplyOptimizerResponse* response);
  // Before a step: asks every worker of the turn whether its gradients are finite
  // (CheckGradients; changes nothing), by `deadline` (the step's: check and step share one).
  // *non_finite: the first tensor one of them found non-finite (empty: all finite).
  absl::Status FindNonFiniteGradient(Turn& turn, absl::Time deadline, std::string* non_finite);
  // The step refused or skipped for a non-finite gradient `tensor`: FAILED_PRECONDITION
  // changing nothing, or with skip_non_finite the gradients zeroed (by `deadline`) and an OK
  // answer saying so.
  absl::Status RefuseOrSkipStep(Turn& turn, absl::Time deadline,
                                const v1::ApplyOptimizerRequest& request, const std::string& tensor,
                                v1::ApplyOptimizerResponse* response);
  // ApplyOptimizer with num_ranks > 1 (server/data_parallel_steps.h): the call that completes
  // its step applies it with the gradients times 1/num_ranks; the others wait for its answer,
  // within their deadline and options_.dp_step_timeout.
  absl::Status ApplyDataParallelStep(grpc::ServerContextBase* context, std::shared_ptr<Layer> layer,
                                     const v1::ApplyOptimizerRequest& request,
                                     v1::ApplyOptimizerResponse* response);
  // Two-phase changes (LoadCheckpoint, SetWeights): the workers staged the change under
  // `stage_id`; CommitStage applies it on every worker (a failure part-way diverges the
  // layer, as ChangeOnWorkers; reset_optimizer: a SetWeights repair, the workers also drop
  // the optimizer state and zero the gradients); AbortStage drops it after a failed stage
  // (best effort; not after a deadline: the stage calls still running keep nothing, and the
  // turn waits for them).
  absl::Status CommitStage(Turn& turn, const char* method, uint64_t stage_id,
                           bool reset_optimizer = false);
  void AbortStage(Turn& turn, uint64_t stage_id, const absl::Status& why);
  v1::LayerInfo Info(const Layer& layer) const;
  // RecreateLayers: whether `layer` keeps the weights its workers hold (it is on every worker
  // of the new set, was not restored from the store by this moed, and is not a durable layer
  // with diverged parameters, which reloads its durable state instead). *durable: whether it
  // has durable state to reload.
  bool KeepsWeights(Layer& layer, bool on_every_worker, bool* durable) const;
  // ApplyOptimizer's expected_optimizer_step (proto/moe.proto): ABORTED unless the layer is
  // at `expected` with its gradients intact (not dropped since the last step or zeroing).
  static absl::Status CheckExpectedStep(Layer& layer, int64_t expected);
  // moe_service_durable.cc. After a change to the turn's layer succeeded on every worker:
  // checkpoints it into the durable store when durable_schedule_ says one is due (`force`:
  // now). A failure is
  // logged and kept in LayerInfo.durable_error; the change stands. No-op without a store.
  void AfterChange(Turn& turn, bool optimizer_step, bool force);
  // The workers save the turn's layer into a new durable checkpoint; the store commits it.
  absl::Status SaveDurable(Turn& turn);
  // RecreateLayers: the layer, just created from init_seed on `set`, loads its durable
  // checkpoint (collective LoadCheckpoint). OK with nothing to load.
  absl::Status LoadDurable(const WorkerSet& set, Layer& layer);
  // admission_'s Books::for_each_layer: every listed layer's config and kept steps' bytes.
  void VisitHeldLayers(const WorkerMemoryAdmission::LayerVisitor& visit) const;
  // A layer's kept steps' bytes, summed over the workers (under its mu).
  static int64_t SavedBytes(const Layer& layer);
  // The saved-step budget and ttl of every layer (options_).
  SavedStepLimits SavedLimits() const;
  absl::Time InternalDeadline(grpc::ServerContextBase* context, bool collective) const;
  absl::Time InternalDeadline(absl::Time caller_deadline, bool collective) const;
  // DeleteLayer of `layer_id` on every worker of `set` (best effort: a worker that misses it
  // drops the layer at its next generation).
  void DropOnWorkers(const WorkerSet& set, uint64_t layer_id);
  // CreateLayer's steps after the layer is listed (its turn held): create it on every serving
  // worker (those that did drop it again on a failure), then register it in the durable store
  // if any. UnlistFailedLayer takes it off the books after a failure.
  absl::Status CreateOnWorkers(grpc::ServerContextBase* context,
                               const std::shared_ptr<Layer>& layer);
  absl::Status RegisterDurable(const WorkerSet& set, const std::shared_ptr<Layer>& layer);
  void UnlistFailedLayer(const std::shared_ptr<Layer>& layer);
  // Forward with keep_for_backward, after the workers saved `step_id`: OK keeps it booked;
  // CANCELLED (the client left) or RESOURCE_EXHAUSTED (over --max_saved_bytes) drops it from
  // the books and releases it on the workers.
  absl::Status KeepStepOrRefuse(Turn& turn, const StepCaller& caller, uint64_t step_id,
                                int64_t saved_bytes);
  // After a Forward's workers answered: its per-expert counts added to the layer's load and,
  // with `keep`, the step booked as saved.
  void BookForward(Layer& layer, const std::vector<int64_t>& counts, bool keep, uint64_t step_id,
                   const SavedStep& step);
  // The bytes per worker of a saved step of `layer` (0 when it has none under `step_id`), as
  // admission_ counts them.
  int64_t SavedBytesPerWorker(Layer& layer, uint64_t step_id) const;
  // Backward's saved step, taken off the books (consumed, whatever the Backward's outcome)
  // once it matches the request: d_out's tokens, and the output region if any.
  absl::StatusOr<SavedStep> TakeSavedStep(Layer& layer, uint64_t step_id, int64_t d_out_tokens,
                                          ShmStep* shm);
  // Releases steps on the workers (best effort; they are dropped from the books anyway).
  void ReleaseOnWorkers(const WorkerSet& set, const Layer& layer,
                        const std::vector<uint64_t>& step_ids);
  // Whole-layer tensors gathered from the workers' shards.
  absl::Status GatherTensors(const WorkerSet& set, const Layer& layer, bool gradients,
                             const std::vector<std::string>& names,
                             grpc::ServerContextBase* context, std::vector<NamedTensor>* out);
  absl::Status ResolveNames(const Layer& layer, bool gradients,
                            const google::protobuf::RepeatedPtrField<std::string>& requested,
                            std::vector<std::string>* names) const;
  // GetWeights / GetGradients: validation, the layer's turn, gather, then the chunk stream.
  absl::Status ServeTensors(grpc::ServerContextBase* context, const std::string& layer,
                            bool gradients,
                            const google::protobuf::RepeatedPtrField<std::string>& requested,
                            int64_t max_chunk_bytes, StreamWriter<v1::TensorChunk>* writer);
  // SetWeights, first phase: the whole stream read (drained after the first error) and every
  // value checked before any worker sees it. *layer: the layer the stream names; each tensor's
  // bytes are added to *held (HoldStreamBytes) from its first chunk on.
  absl::StatusOr<std::vector<NamedTensor>> ReadWeightsStream(
      StreamReader<v1::SetWeightsRequest>* reader, std::shared_ptr<Layer>* layer, int64_t* held);
  // SetWeights on a diverged layer that sets every parameter: it repairs the layer (the commit
  // also resets the optimizer state and gradients on every worker).
  static bool RepairsDiverged(Layer& layer, const std::vector<NamedTensor>& tensors);
  // SetWeights, second phase: every worker of the turn receives its shards of `tensors` and
  // keeps them staged under `stage_id` (CommitStage applies them).
  absl::Status StageWeights(Turn& turn, grpc::ServerContextBase* context, uint64_t stage_id,
                            const std::vector<NamedTensor>& tensors);
  grpc::Status Finish(const char* method, absl::Time start, const absl::Status& status);
  // Authorize (server/auth.h) that counts a refusal in metrics (moed_denied_total).
  absl::Status Allow(const grpc::ServerContextBase& context, Role role) const;
  // HandlerPool's per-client key of a call: its token's hash (with a tokens file), else the
  // caller's address without port.
  std::string ClientOf(const grpc::ServerContextBase& context) const;
  // A unary call: the role check inline (a refused call takes no thread), then the body on
  // handlers_ under the caller's per-client limit (moe_service_rpcs.cc).
  template <typename Body>
  grpc::ServerUnaryReactor* RunAuthorized(grpc::CallbackServerContext* context, Role role,
                                          Body body);
  // Forward / Backward from their raw bytes (moe_service_rpcs.cc): AdmitRawStep, then
  // AnswerRawStep on a handler thread.
  template <typename Request>
  grpc::ServerUnaryReactor* RunRawStep(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* wire, grpc::ByteBuffer* answer);
  // The halves of a raw step, shared by the gRPC call and a step channel's record: the role
  // checks (`allow`: kInfer / kTrain by the request, kTrain also for a step to keep) and the
  // split around the tensor field (a request that does not parse is INVALID_ARGUMENT); then
  // DoForward / DoBackward and the answer encoded around its tensor.
  template <typename Request>
  absl::Status AdmitRawStep(const std::function<absl::Status(Role)>& allow,
                            const grpc::ByteBuffer& wire, Request* request, TensorBytes* input);
  template <typename Request>
  grpc::Status AnswerRawStep(const StepCaller& caller, const Request& request,
                             const TensorBytes& input, grpc::ByteBuffer* answer);
  // max_inflight_bytes: reserves `bytes` for a streamed step's tensor (*held = bytes, for
  // ReleaseInflightBytes), or RESOURCE_EXHAUSTED naming the flag when the steps being
  // assembled already hold too much.
  absl::Status HoldInflightBytes(int64_t bytes, int64_t* held);
  void ReleaseInflightBytes(int64_t bytes);
  // max_stream_bytes: adds `bytes` to what this stream holds (*held) unless other streams
  // already hold something and the total would pass the limit (RESOURCE_EXHAUSTED).
  absl::Status HoldStreamBytes(int64_t bytes, int64_t* held);
  void ReleaseStreamBytes(int64_t held);

  const ServiceOptions options_;
  WorkerPool* const pool_;
  Metrics* const metrics_;
  std::atomic<uint64_t> next_step_id_{1};

  // Shared by every worker operation; exclusive while RecreateLayers runs.
  absl::Mutex setup_mu_;
  // The layers by name, their ids and --max_layers (server/layer_registry.h).
  LayerRegistry layers_{options_.max_layers};
  // When a durable layer is checkpointed into options_.durable_store, and its durable books
  // (server/durable_schedule.h).
  const DurableSchedule durable_schedule_{options_.durable_store, options_.durable_every_steps,
                                          options_.durable_every};

  // Set when options_.allow_client_shm.
  std::unique_ptr<SharedMemoryRegistry> shm_;
  // Set when options_.shm_relay.
  std::unique_ptr<RelayPool> relay_;
  // Staged tensors (StageTensor, FetchStaged, x_staged / out_staged ...); its buffers come
  // from relay_ (UNIMPLEMENTED without it).
  std::unique_ptr<StagingTable> staging_;

  absl::Mutex stream_mu_;
  int64_t stream_bytes_ ABSL_GUARDED_BY(stream_mu_) = 0;    // held by open tensor streams
  int64_t inflight_bytes_ ABSL_GUARDED_BY(stream_mu_) = 0;  // streamed steps' tensors

  std::atomic<bool> stopping_drains_{false};  // set first by the destructor

  // Admission control (--worker_memory_bytes): the budget and the reservations of admitted
  // calls still running. Its lock is taken before layers_' and any layer's mu (it reads
  // the books through VisitHeldLayers under it), never after.
  WorkerMemoryAdmission admission_;

  absl::Mutex housekeeping_mu_;
  bool stopping_ ABSL_GUARDED_BY(housekeeping_mu_) = false;
  std::thread housekeeping_;
  // Set when options_.allow_client_shm; closed first by the destructor (its threads submit
  // to handlers_).
  std::unique_ptr<StepChannels> step_channels_;
  // With tokens: each channel owner's (ClientOf's) token hash, for CloseRevokedStepChannels.
  absl::Mutex channel_tokens_mu_;
  std::map<std::string, std::string> channel_tokens_ ABSL_GUARDED_BY(channel_tokens_mu_);
  ForwardBatcher forward_batcher_{options_.forward_batching};

  // Last: destroyed first, so its threads are joined before anything their bodies use.
  HandlerPool handlers_;
};

}  // namespace moe

#endif  // MOED_SERVER_MOE_SERVICE_H_
