// moed -> moe-worker step calls whose tensor bytes are never copied in moed. A Forward's x
// (a Backward's d_out) arrives in moed as received slices (server/moe_service.h: Forward and
// Backward are raw); each worker's request is written by hand (proto/tensor_wire.h) as a
// grpc::ByteBuffer of a header slice and references to the rank's rows of those slices. The
// worker answers the same way around its output tensor (TakeTensorBytes;
// server/authenticated_worker.cc), and moed keeps the answer's bytes as references to what
// it received, which become its own answer's bytes.
//
// A worker on moed's host with step rings (server/worker_rings.h, --worker_ring) gets the
// same request bytes as a ring record instead, when a channel is free; its answer's bytes are
// the same too, so the caller cannot tell the two paths apart but by their speed.
//
//   std::vector<grpc::Slice> rows;
//   x_bytes.AppendSlices(begin * row_bytes, n * row_bytes, &borrowed, &rows);
//   grpc::ByteBuffer wire = EncodeWithTensor(head, /*tensor_field=*/4, x_head, std::move(rows));
//   RETURN_IF_ERROR(CallWorkerWithTensor(set.Route(r), ctx, kWorkerForwardMethod, wire,
//                                        /*tensor_field=*/1, &answer, &out_bytes));
#ifndef MOED_SERVER_WORKER_CALL_H_
#define MOED_SERVER_WORKER_CALL_H_

#include <grpcpp/grpcpp.h>

#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "proto/tensor_wire.h"
#include "proto/worker.grpc.pb.h"
#include "server/worker_rings.h"

namespace moe {

inline constexpr char kWorkerForwardMethod[] = "/moe.internal.Worker/Forward";
inline constexpr char kWorkerBackwardMethod[] = "/moe.internal.Worker/Backward";

// How moed reaches one worker with a step call (WorkerSet::Route).
struct WorkerRoute {
  std::shared_ptr<grpc::Channel> channel;
  WorkerRings* rings = nullptr;  // null: gRPC only (another host, --worker_ring=false, refused)
  // Whether moed cancelled the call of `context` (TryCancel); polled by ring calls, which a
  // grpc::ClientContext cannot cancel. Null: never.
  std::function<bool(const grpc::ClientContext* context)> cancelled;
};

// The most tensor bytes one moed <-> worker gRPC message may carry: gRPC's message size limit
// and protobuf's lengths are ints (2^31 - 1 bytes), less room for the message's other fields.
// Steps whose tensors travel in shared memory (client regions, moed's relay buffers) have no
// such bound.
inline constexpr int64_t kMaxWorkerMessageTensorBytes = INT_MAX - (int64_t{1} << 16);

// Checked before a step calls any worker: rank r's rows [offsets[r], offsets[r + 1]) of the
// tensor `field` ("x", "out", ...), row_bytes each, travel in one gRPC message to or from that
// worker, so each rank's share must be at most `limit` bytes. Otherwise RESOURCE_EXHAUSTED
// naming the field, the rank, the bytes and the ways out; refused up front because a call
// that failed on one rank alone would leave the others waiting in the step's collectives.
absl::Status CheckWorkerMessageSizes(absl::string_view field, const std::vector<int64_t>& offsets,
                                     size_t row_bytes,
                                     int64_t limit = kMaxWorkerMessageTensorBytes);

// A blocking unary call of `method` (kWorkerForwardMethod or kWorkerBackwardMethod) with an
// encoded request (cancellation and deadline from `context`, as with a stub), on a step ring
// when the route has a free one, else by gRPC; the answer split around its field
// `tensor_field` (DecodeWithTensor): the fields in *head, the tensor's bytes in *bytes as
// references to the received slices or ring record (not copied). An answer that does not
// parse is INTERNAL.
absl::Status CallWorkerWithTensor(const WorkerRoute& route, grpc::ClientContext* context,
                                  const char* method, const grpc::ByteBuffer& request,
                                  int tensor_field, google::protobuf::MessageLite* head,
                                  TensorBytes* bytes);

// Worker.ReleaseStep, on a step ring when the route has a free one, else by `stub`.
absl::Status CallWorkerReleaseStep(const WorkerRoute& route, internal::Worker::Stub* stub,
                                   grpc::ClientContext* context,
                                   const internal::WorkerReleaseStepRequest& request);

}  // namespace moe

#endif  // MOED_SERVER_WORKER_CALL_H_
