// moe-worker's gRPC service (moe.internal.Worker, proto/worker.proto): this process's shard of
// every layer, the saved steps awaiting backward, and the per-layer communicators.
//
// Threading. gRPC's synchronous API runs each call on its own thread. (Unlike moed's
// services, not the callback API: handing each call to a pool thread measured 2.5-5x the
// latency of small steps on a 2-core host; see docs/DECISIONS.md.) Each layer lives in a
// LayerSlot with its own mutex, backend and communicator (server/device.h), so calls on one layer
// run one at a time while different layers run concurrently. The front end issues a layer's
// collective calls (CreateLayer, Forward, Backward) in the same order to every worker and waits for
// all of them before the next, so every rank enters the same collectives in the same order. Ping
// and Setup never wait for a layer: a step stuck in a collective (a dead peer) cannot block health
// checks. Setup retires the slots (an in-flight call keeps its slot alive through a shared_ptr
// until its collective times out or fails); the new generation's CreateLayer either restores a
// retired layer's parameters and optimizer state (when every worker still has it) or frees it
// first.
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
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "engine/checkpoint.h"
#include "engine/comm/kv_store.h"
#include "engine/moe_layer.h"
#include "proto/tensor_wire.h"
#include "proto/worker.grpc.pb.h"
#include "server/device.h"
#include "server/worker_shm.h"

namespace moe {

class WorkerService final : public internal::Worker::Service {
 public:
  // engine: how its backends, communicators and layers are made (MakeWorkerDevice,
  // MoeLayer::Create); checked by the caller (CheckEngineOptions, server/engine_flags.h).
  WorkerService(std::string device, std::shared_ptr<KeyValueStore> store,
                EngineOptions engine = {});
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

  grpc::Status Setup(grpc::ServerContext*, const internal::SetupRequest*,
                     internal::SetupResponse*) override;
  grpc::Status CreateLayer(grpc::ServerContext*, const internal::WorkerCreateLayerRequest*,
                           internal::WorkerCreateLayerResponse*) override;
  grpc::Status DeleteLayer(grpc::ServerContext*, const internal::WorkerLayerRequest*,
                           internal::WorkerEmpty*) override;
  grpc::Status Forward(grpc::ServerContext*, const internal::WorkerForwardRequest*,
                       internal::WorkerForwardResponse*) override;
  grpc::Status Backward(grpc::ServerContext*, const internal::WorkerBackwardRequest*,
                        internal::WorkerBackwardResponse*) override;
  // The same on a request whose tensor's bytes (x, d_out) were kept where they arrived
  // (proto/tensor_wire.h: request->x() has datatype and shape, *x_bytes its raw_data, copied
  // once into the engine's input), with the output tensor (out, d_x) handed back in *tensor
  // instead of copied into the response (every other field filled): the caller sends its
  // bytes without a copy (server/authenticated_worker.cc). When the request named a
  // shared-memory region for the output, the output went there, the response's tensor field
  // is set (datatype and shape) and *tensor is left empty.
  grpc::Status Forward(grpc::ServerContext*, const internal::WorkerForwardRequest*,
                       const TensorBytes& x_bytes, internal::WorkerForwardResponse*, Tensor* out);
  grpc::Status Backward(grpc::ServerContext*, const internal::WorkerBackwardRequest*,
                        const TensorBytes& d_out_bytes, internal::WorkerBackwardResponse*,
                        Tensor* d_x);
  grpc::Status ReleaseStep(grpc::ServerContext*, const internal::WorkerReleaseStepRequest*,
                           internal::WorkerEmpty*) override;
  grpc::Status GetTensors(grpc::ServerContext*, const internal::WorkerGetTensorsRequest*,
                          grpc::ServerWriter<v1::TensorChunk>*) override;
  grpc::Status SetTensors(grpc::ServerContext*,
                          grpc::ServerReader<internal::WorkerSetTensorsRequest>*,
                          internal::WorkerEmpty*) override;
  grpc::Status ZeroGradients(grpc::ServerContext*, const internal::WorkerLayerRequest*,
                             internal::WorkerEmpty*) override;
  grpc::Status ApplyOptimizer(grpc::ServerContext*, const internal::WorkerOptimizerRequest*,
                              internal::WorkerEmpty*) override;
  grpc::Status CheckGradients(grpc::ServerContext*, const internal::WorkerLayerRequest*,
                              internal::WorkerGradientCheck*) override;
  grpc::Status UpdateExpertBias(grpc::ServerContext*, const internal::WorkerExpertBiasRequest*,
                                internal::WorkerExpertBiasResponse*) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext*, const internal::WorkerCheckpointRequest*,
                              internal::WorkerEmpty*) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext*, const internal::WorkerCheckpointRequest*,
                              internal::WorkerEmpty*) override;
  grpc::Status CommitStage(grpc::ServerContext*, const internal::WorkerCommitRequest*,
                           internal::WorkerEmpty*) override;
  grpc::Status Ping(grpc::ServerContext*, const internal::PingRequest*,
                    internal::PingResponse*) override;
  grpc::Status Shutdown(grpc::ServerContext*, const internal::WorkerEmpty*,
                        internal::WorkerEmpty*) override;
  grpc::Status ForgetSharedMemory(grpc::ServerContext*, const internal::ForgetSharedMemoryRequest*,
                                  internal::WorkerEmpty*) override;

 private:
  struct LayerSlot {
    std::string name;
    absl::Mutex mu;  // serialises every call on this layer
    WorkerDevice device ABSL_GUARDED_BY(mu);
    std::unique_ptr<MoeLayer> layer ABSL_GUARDED_BY(mu);
    std::map<uint64_t, std::unique_ptr<StepContext>> steps ABSL_GUARDED_BY(mu);
    // op_id of the last ApplyOptimizer / UpdateExpertBias applied (0: none): a retry of it
    // is answered without applying it twice.
    uint64_t last_op ABSL_GUARDED_BY(mu) = 0;
    // A change read and verified but not applied, awaiting CommitStage: a checkpoint
    // (LoadCheckpoint STAGE) or tensors (SetTensors with a stage_id). At most one of them.
    uint64_t stage_id ABSL_GUARDED_BY(mu) = 0;
    std::unique_ptr<StagedCheckpoint> staged ABSL_GUARDED_BY(mu);
    std::vector<NamedTensor> staged_tensors ABSL_GUARDED_BY(mu);
    void DropStage() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      stage_id = 0;
      staged.reset();
      staged_tensors.clear();
    }
    std::atomic<int64_t> memory_bytes{0};  // backend bytes after the last call (telemetry)
    std::atomic<int64_t> peak_bytes{0};
    ~LayerSlot();
  };

  // The front end gave up on the call: cancelled, or its deadline passed (never for a null
  // context: a call made in-process).
  static bool CallCancelled(grpc::ServerContext* context);
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
  // A step's input (x, d_out): a view of the client's shared-memory region when the request
  // names one (`slice` non-null; the engine reads it in place, worker_shm.h), else its bytes
  // from the message, copied once.
  absl::StatusOr<ShmTensor> StepInput(absl::string_view field, const v1::Tensor& meta,
                                      const internal::WorkerShmSlice* slice,
                                      const TensorBytes& bytes);

  const std::string device_;
  const std::shared_ptr<KeyValueStore> store_;
  const EngineOptions engine_;
  absl::Notification shutdown_;
  WorkerShmMappings shm_;  // client shared-memory regions (thread-safe)
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
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_SERVICE_H_
