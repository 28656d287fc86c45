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

class AuthenticatedWorkerService final : public internal::Worker::Service {
 public:
  // `inner` outlives this service.
  // Forward and Backward are served by ForwardBytes/BackwardBytes (same thread model, same
  // checks) so that the output tensor is sent without a copy.
  AuthenticatedWorkerService(WorkerService* inner, ClusterSecret secret);

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
