// moe.internal.Worker as moe-worker serves it: every RPC first checks the cluster secret
// (server/cluster_secret.h), then runs the WorkerService's handler. A caller without the
// secret reaches nothing (UNAUTHENTICATED / PERMISSION_DENIED): not Shutdown, not Setup, not
// Ping. An RPC added to the proto but not here answers UNIMPLEMENTED, never unchecked
// (tests/server/internal_plane_test.cc calls every method of the service's descriptor).
//
//   WorkerService service("cpu", store);
//   AuthenticatedWorkerService authenticated(&service, secret);
//   builder.RegisterService(&authenticated);
#ifndef MOED_SERVER_AUTHENTICATED_WORKER_H_
#define MOED_SERVER_AUTHENTICATED_WORKER_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/worker.grpc.pb.h"
#include "server/cluster_secret.h"
#include "server/worker_ring_server.h"
#include "server/worker_service.h"

namespace moe {

// The RPCs whose body is "check the cluster secret, then the WorkerService's handler of the
// same name with the same arguments": X(method, input, output) with the generated service's
// argument types. One row each; the header declares the overrides from it and
// authenticated_worker.cc defines them from it, so every row gets the same check, statuses and
// deadline handling (the inner handler sees the caller's context, deadline included). Forward
// and Backward are listed for completeness: the service serves them as raw bytes
// (ForwardBytes / BackwardBytes below), so their typed overrides are never reached from the
// wire. OpenStepChannels is not a row: its body is this class's own (the step rings).
#define MOE_WORKER_CHECKED_RPCS(X)                                                                \
  X(Setup, const internal::SetupRequest*, internal::SetupResponse*)                               \
  X(CreateLayer, const internal::WorkerCreateLayerRequest*, internal::WorkerCreateLayerResponse*) \
  X(DeleteLayer, const internal::WorkerLayerRequest*, internal::WorkerEmpty*)                     \
  X(Forward, const internal::WorkerForwardRequest*, internal::WorkerForwardResponse*)             \
  X(Backward, const internal::WorkerBackwardRequest*, internal::WorkerBackwardResponse*)          \
  X(ReleaseStep, const internal::WorkerReleaseStepRequest*, internal::WorkerEmpty*)               \
  X(GetTensors, const internal::WorkerGetTensorsRequest*, grpc::ServerWriter<v1::TensorChunk>*)   \
  X(SetTensors, grpc::ServerReader<internal::WorkerSetTensorsRequest>*, internal::WorkerEmpty*)   \
  X(ZeroGradients, const internal::WorkerLayerRequest*, internal::WorkerEmpty*)                   \
  X(ApplyOptimizer, const internal::WorkerOptimizerRequest*, internal::WorkerEmpty*)              \
  X(CheckGradients, const internal::WorkerLayerRequest*, internal::WorkerGradientCheck*)          \
  X(UpdateExpertBias, const internal::WorkerExpertBiasRequest*,                                   \
    internal::WorkerExpertBiasResponse*)                                                          \
  X(SaveCheckpoint, const internal::WorkerCheckpointRequest*, internal::WorkerEmpty*)             \
  X(LoadCheckpoint, const internal::WorkerCheckpointRequest*, internal::WorkerEmpty*)             \
  X(CommitStage, const internal::WorkerCommitRequest*, internal::WorkerEmpty*)                    \
  X(Ping, const internal::PingRequest*, internal::PingResponse*)                                  \
  X(Shutdown, const internal::WorkerEmpty*, internal::WorkerEmpty*)                               \
  X(ForgetSharedMemory, const internal::ForgetSharedMemoryRequest*, internal::WorkerEmpty*)

class AuthenticatedWorkerService final : public internal::Worker::Service {
 public:
  // `inner` outlives this service.
  // Forward and Backward are served by ForwardBytes/BackwardBytes (same thread model, same
  // checks) so that the output tensor is sent without a copy. ring_spin: the step rings'
  // doorbell spin (--ring_spin_us).
  AuthenticatedWorkerService(WorkerService* inner, ClusterSecret secret,
                             absl::Duration ring_spin = absl::ZeroDuration());

#define MOE_DECLARE_CHECKED_RPC(Method, Input, Output) \
  grpc::Status Method(grpc::ServerContext*, Input, Output) override;
  MOE_WORKER_CHECKED_RPCS(MOE_DECLARE_CHECKED_RPC)
#undef MOE_DECLARE_CHECKED_RPC
  // Attaches to moed's step rings (server/worker_ring_server.h); their records run the same
  // bodies as Forward, Backward and ReleaseStep (server/worker_step_bytes.h).
  grpc::Status OpenStepChannels(grpc::ServerContext*, const internal::OpenStepChannelsRequest*,
                                internal::OpenStepChannelsResponse*) override;

 private:
  using BytesStream = grpc::ServerUnaryStreamer<grpc::ByteBuffer, grpc::ByteBuffer>;
  // Forward/Backward on the raw request bytes: split (the tensor's bytes left in place for one
  // copy into the engine's input), run, answer with the response's fields in a header slice
  // and the output tensor's own bytes (proto/tensor_wire.h).
  grpc::Status ForwardBytes(grpc::ServerContext* context, BytesStream* stream);
  grpc::Status BackwardBytes(grpc::ServerContext* context, BytesStream* stream);
  // A step ring record's answer (server/worker_rings.h: WorkerRingKind).
  absl::StatusOr<std::string> AnswerRingRecord(uint8_t kind, absl::string_view request) const;

  WorkerService* const inner_;
  const ClusterSecret secret_;
  WorkerRingServer rings_;  // destroyed first: its threads call inner_
};

}  // namespace moe

#endif  // MOED_SERVER_AUTHENTICATED_WORKER_H_
