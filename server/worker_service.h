// moe-worker's gRPC service (moe.internal.Worker, proto/worker.proto): this process's shard of
// every layer, the saved steps awaiting backward, and the per-layer communicators.
//
// Threading. The service uses gRPC's callback API: every call that may block (Setup's
// rendezvous, a layer's mutex, a collective, freeing a layer) runs its body on a thread of the
// service's own HandlerPool (server/callback.h), never on gRPC's callback threads; Ping and
// Shutdown only take mu_ briefly and finish on gRPC's thread. The pool has `max_handlers`
// threads (default 256: the front end sends one call per layer at a time, plus Setup); a call
// that finds them all busy is RESOURCE_EXHAUSTED. Each layer lives in a LayerSlot with its
// own mutex, backend and communicator (server/device.h), so calls on one layer run one at a
// time while different layers run concurrently. The front end issues a layer's collective
// calls (CreateLayer, Forward, Backward) in the same order to every worker and waits for all
// of them before the next, so every rank enters the same collectives in the same order.
// Ping and Setup never wait for a layer: a step stuck in a collective (a dead peer) cannot
// block health checks. Setup retires the slots (an in-flight call keeps its slot alive
// through a shared_ptr until its collective times out or fails); the new generation's
// CreateLayer either restores a retired layer's parameters and optimizer state (when every
// worker still has it) or frees it first. grpc::Server::Shutdown waits for the bodies still
// running (a collective ends at its timeout).
//
//   WorkerService service("cpu", store);
//   builder.RegisterService(&service);
//   ...; service.WaitForShutdownRequest();
#ifndef MOED_SERVER_WORKER_SERVICE_H_
#define MOED_SERVER_WORKER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "engine/comm/kv_store.h"
#include "engine/moe_layer.h"
#include "proto/worker.grpc.pb.h"
#include "server/callback.h"
#include "server/device.h"

namespace moe {

class WorkerService final : public internal::Worker::CallbackService {
 public:
  // cpu_threads: see MakeWorkerDevice. max_handlers: calls whose bodies may run at once.
  WorkerService(std::string device, std::shared_ptr<KeyValueStore> store, int cpu_threads = 0,
                int max_handlers = 256);
  ~WorkerService() override;

  // Blocks until a Shutdown call arrived.
  void WaitForShutdownRequest() { shutdown_.WaitForNotification(); }
  bool HasShutdownRequest() const { return shutdown_.HasBeenNotified(); }
  // Time of the last Ping from the front end (for the orphan watchdog).
  absl::Time last_ping() const;
  // Counts as a ping (a successful join).
  void NoteContact();
  int64_t generation() const;
  // The communicators of the current generation are up (its Setup finished): readiness.
  bool ready() const;
  // Called (without locks held) whenever ready() may have changed: a Setup began or finished.
  // Set before the server starts.
  void set_on_ready_changed(std::function<void()> callback) {
    on_ready_changed_ = std::move(callback);
  }

  // The calls (server/callback.h): each body runs on handlers_ unless noted.
  grpc::ServerUnaryReactor* Setup(grpc::CallbackServerContext* context,
                                  const internal::SetupRequest* request,
                                  internal::SetupResponse* response) override {
    return RunUnary(context, &handlers_, [=] { return DoSetup(request, response); });
  }
  grpc::ServerUnaryReactor* CreateLayer(grpc::CallbackServerContext* context,
                                        const internal::WorkerCreateLayerRequest* request,
                                        internal::WorkerCreateLayerResponse* response) override {
    return RunUnary(context, &handlers_, [=] { return DoCreateLayer(request, response); });
  }
  grpc::ServerUnaryReactor* DeleteLayer(grpc::CallbackServerContext* context,
                                        const internal::WorkerLayerRequest* request,
                                        internal::WorkerEmpty*) override {
    return RunUnary(context, &handlers_, [=] { return DoDeleteLayer(request); });
  }
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const internal::WorkerForwardRequest* request,
                                    internal::WorkerForwardResponse* response) override {
    return RunUnary(context, &handlers_, [=] { return DoForward(request, response); });
  }
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext* context,
                                     const internal::WorkerBackwardRequest* request,
                                     internal::WorkerBackwardResponse* response) override {
    return RunUnary(context, &handlers_, [=] { return DoBackward(request, response); });
  }
  grpc::ServerUnaryReactor* ReleaseStep(grpc::CallbackServerContext* context,
                                        const internal::WorkerReleaseStepRequest* request,
                                        internal::WorkerEmpty*) override {
    return RunUnary(context, &handlers_, [=] { return DoReleaseStep(request); });
  }
  grpc::ServerWriteReactor<v1::TensorChunk>* GetTensors(
      grpc::CallbackServerContext*, const internal::WorkerGetTensorsRequest* request) override {
    return StreamWriter<v1::TensorChunk>::Start(
        &handlers_,
        [=](StreamWriter<v1::TensorChunk>* writer) { return DoGetTensors(request, writer); });
  }
  grpc::ServerReadReactor<internal::WorkerSetTensorsRequest>* SetTensors(
      grpc::CallbackServerContext*, internal::WorkerEmpty*) override {
    return StreamReader<internal::WorkerSetTensorsRequest>::Start(
        &handlers_, [=](StreamReader<internal::WorkerSetTensorsRequest>* reader) {
          return DoSetTensors(reader);
        });
  }
  grpc::ServerUnaryReactor* ZeroGradients(grpc::CallbackServerContext* context,
                                          const internal::WorkerLayerRequest* request,
                                          internal::WorkerEmpty*) override {
    return RunUnary(context, &handlers_, [=] { return DoZeroGradients(request); });
  }
  grpc::ServerUnaryReactor* ApplyOptimizer(grpc::CallbackServerContext* context,
                                           const internal::WorkerOptimizerRequest* request,
                                           internal::WorkerEmpty*) override {
    return RunUnary(context, &handlers_, [=] { return DoApplyOptimizer(request); });
  }
  grpc::ServerUnaryReactor* UpdateExpertBias(
      grpc::CallbackServerContext* context, const internal::WorkerExpertBiasRequest* request,
      internal::WorkerExpertBiasResponse* response) override {
    return RunUnary(context, &handlers_, [=] { return DoUpdateExpertBias(request, response); });
  }
  grpc::ServerUnaryReactor* SaveCheckpoint(grpc::CallbackServerContext* context,
                                           const internal::WorkerCheckpointRequest* request,
                                           internal::WorkerEmpty*) override {
    return RunUnary(context, &handlers_, [=] { return DoSaveCheckpoint(request); });
  }
  grpc::ServerUnaryReactor* LoadCheckpoint(grpc::CallbackServerContext* context,
                                           const internal::WorkerCheckpointRequest* request,
                                           internal::WorkerEmpty*) override {
    return RunUnary(context, &handlers_, [=] { return DoLoadCheckpoint(request); });
  }
  // On gRPC's thread: mu_ only (no step holds it for long), so a full pool or a stuck step
  // cannot fail the front end's liveness pings.
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* context, const internal::PingRequest*,
                                 internal::PingResponse* response) override;
  // On gRPC's thread.
  grpc::ServerUnaryReactor* Shutdown(grpc::CallbackServerContext* context,
                                     const internal::WorkerEmpty*, internal::WorkerEmpty*) override;

 private:
  struct LayerSlot {
    std::string name;
    absl::Mutex mu;  // serialises every call on this layer
    WorkerDevice device ABSL_GUARDED_BY(mu);
    std::unique_ptr<MoeLayer> layer ABSL_GUARDED_BY(mu);
    std::map<uint64_t, std::unique_ptr<StepContext>> steps ABSL_GUARDED_BY(mu);
    std::atomic<int64_t> memory_bytes{0};  // backend bytes after the last call (telemetry)
    std::atomic<int64_t> peak_bytes{0};
    ~LayerSlot();
  };

  // The bodies of the calls above (they run on handlers_; Ping's on gRPC's thread).
  grpc::Status DoSetup(const internal::SetupRequest* request, internal::SetupResponse* response);
  grpc::Status DoCreateLayer(const internal::WorkerCreateLayerRequest* request,
                             internal::WorkerCreateLayerResponse* response);
  grpc::Status DoDeleteLayer(const internal::WorkerLayerRequest* request);
  grpc::Status DoForward(const internal::WorkerForwardRequest* request,
                         internal::WorkerForwardResponse* response);
  grpc::Status DoBackward(const internal::WorkerBackwardRequest* request,
                          internal::WorkerBackwardResponse* response);
  grpc::Status DoReleaseStep(const internal::WorkerReleaseStepRequest* request);
  grpc::Status DoGetTensors(const internal::WorkerGetTensorsRequest* request,
                            StreamWriter<v1::TensorChunk>* writer);
  grpc::Status DoSetTensors(StreamReader<internal::WorkerSetTensorsRequest>* reader);
  grpc::Status DoZeroGradients(const internal::WorkerLayerRequest* request);
  grpc::Status DoApplyOptimizer(const internal::WorkerOptimizerRequest* request);
  grpc::Status DoUpdateExpertBias(const internal::WorkerExpertBiasRequest* request,
                                  internal::WorkerExpertBiasResponse* response);
  grpc::Status DoSaveCheckpoint(const internal::WorkerCheckpointRequest* request);
  grpc::Status DoLoadCheckpoint(const internal::WorkerCheckpointRequest* request);
  grpc::Status DoPing(internal::PingResponse* response);

  // The slot of `layer_id` in `generation`: FAILED_PRECONDITION for another generation,
  // NOT_FOUND for an unknown layer.
  absl::StatusOr<std::shared_ptr<LayerSlot>> FindSlot(int64_t generation, uint64_t layer_id);
  static void UpdateMemory(LayerSlot* slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot->mu);
  // The body of a per-layer call: finds the slot (FindSlot's errors), runs fn under the slot's
  // mutex, refreshes the memory telemetry, and returns fn's status as a grpc::Status.
  grpc::Status OnLayer(int64_t generation, uint64_t layer_id,
                       const std::function<absl::Status(LayerSlot*)>& fn);
  // Copies parameters and optimizer state of `from` into `to` (same config).
  static absl::Status CopyLayerState(LayerSlot* from, MoeLayer* to);

  const std::string device_;
  const std::shared_ptr<KeyValueStore> store_;
  const int cpu_threads_;
  absl::Notification shutdown_;
  std::function<void()> on_ready_changed_;

  mutable absl::Mutex mu_;  // guards the membership state and the layer map below
  int64_t generation_ ABSL_GUARDED_BY(mu_) = -1;
  int rank_ ABSL_GUARDED_BY(mu_) = -1;
  int world_size_ ABSL_GUARDED_BY(mu_) = 0;
  std::string store_prefix_ ABSL_GUARDED_BY(mu_);
  CommOptions comm_options_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<WorkerDevice> world_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<LayerSlot>> layers_ ABSL_GUARDED_BY(mu_);
  // The latest instance of each layer of earlier generations, so that CreateLayer with
  // `restore` can copy its parameters and optimizer state (then the entry is dropped; also
  // dropped by CreateLayer without `restore` and by DeleteLayer).
  std::map<uint64_t, std::shared_ptr<LayerSlot>> retired_ ABSL_GUARDED_BY(mu_);
  absl::Time last_ping_ ABSL_GUARDED_BY(mu_) = absl::Now();
  // Last: destroyed first, its destructor waits for the running bodies (which use the members
  // above) and joins its threads.
  HandlerPool handlers_;
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_SERVICE_H_
