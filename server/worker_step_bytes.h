// The worker's per-step calls on serialized bytes: the one body each of Worker.Forward,
// Worker.Backward and Worker.ReleaseStep, shared by the gRPC handlers
// (server/authenticated_worker.cc, after the cluster secret is checked) and the step rings
// (server/worker_ring_server.h, after the channel's setup was). Same bytes in, same bytes out.
//
// Forward/Backward split the request with its tensor's bytes left where they are (one copy
// into the engine's input; proto/tensor_wire.h), run WorkerService's handler and encode the
// answer with the output tensor's own bytes (not copied), or without it when the output went
// to shared memory. A request that does not parse is INVALID_ARGUMENT.
//
//   grpc::ByteBuffer answer;
//   grpc::Status status = ForwardOnBytes(&service, request, &answer);
#ifndef MOED_SERVER_WORKER_STEP_BYTES_H_
#define MOED_SERVER_WORKER_STEP_BYTES_H_

#include <grpcpp/grpcpp.h>

#include "server/worker_service.h"

namespace moe {

grpc::Status ForwardOnBytes(WorkerService* service, const grpc::ByteBuffer& request,
                            grpc::ByteBuffer* answer);
grpc::Status BackwardOnBytes(WorkerService* service, const grpc::ByteBuffer& request,
                             grpc::ByteBuffer* answer);
grpc::Status ReleaseStepOnBytes(WorkerService* service, const grpc::ByteBuffer& request,
                                grpc::ByteBuffer* answer);

}  // namespace moe

#endif  // MOED_SERVER_WORKER_STEP_BYTES_H_
