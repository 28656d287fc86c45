#include "server/authenticated_worker.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"
#include "server/worker_rings.h"
#include "server/worker_step_bytes.h"

namespace moe {
namespace {

// The index of `method` in moe.internal.Worker, as the generated service numbers its methods.
int MethodIndex(const char* method) {
  return internal::WorkerForwardRequest::descriptor()
      ->file()
      ->FindServiceByName("Worker")
      ->FindMethodByName(method)
      ->index();
}

// Reads the one request of a unary call served as a stream.
grpc::Status ReadWire(grpc::ServerUnaryStreamer<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                      grpc::ByteBuffer* wire) {
  if (!stream->Read(wire)) return grpc::Status(grpc::StatusCode::CANCELLED, "no request");
  return grpc::Status::OK;
}

grpc::Status WriteWire(grpc::ServerUnaryStreamer<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                       const grpc::ByteBuffer& answer) {
  if (!stream->Write(answer)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the front end left");
  }
  return grpc::Status::OK;
}

}  // namespace

AuthenticatedWorkerService::AuthenticatedWorkerService(WorkerService* inner, ClusterSecret secret,
                                                       absl::Duration ring_spin)
    : inner_(inner),
      secret_(std::move(secret)),
      rings_(
          [this](uint8_t kind, absl::Time, absl::string_view request) {
            return AnswerRingRecord(kind, request);
          },
          ring_spin) {
  MarkMethodStreamed(MethodIndex("Forward"),
                     new grpc::internal::StreamedUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                         [this](grpc::ServerContext* context, BytesStream* stream) {
                           return ForwardBytes(context, stream);
                         }));
  MarkMethodStreamed(MethodIndex("Backward"),
                     new grpc::internal::StreamedUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                         [this](grpc::ServerContext* context, BytesStream* stream) {
                           return BackwardBytes(context, stream);
                         }));
}

grpc::Status AuthenticatedWorkerService::ForwardBytes(grpc::ServerContext* context,
                                                      BytesStream* stream) {
  grpc::Status status = secret_.Check(*context);
  grpc::ByteBuffer wire, answer;
  if (status.ok()) status = ReadWire(stream, &wire);
  if (status.ok()) status = ForwardOnBytes(inner_, wire, &answer);
  return status.ok() ? WriteWire(stream, answer) : status;
}

grpc::Status AuthenticatedWorkerService::BackwardBytes(grpc::ServerContext* context,
                                                       BytesStream* stream) {
  grpc::Status status = secret_.Check(*context);
  grpc::ByteBuffer wire, answer;
  if (status.ok()) status = ReadWire(stream, &wire);
  if (status.ok()) status = BackwardOnBytes(inner_, wire, &answer);
  return status.ok() ? WriteWire(stream, answer) : status;
}

absl::StatusOr<std::string> AuthenticatedWorkerService::AnswerRingRecord(
    uint8_t kind, absl::string_view request) const {
  // The record's private copy outlives the call: the buffer only points at it.
  grpc::Slice slice(request.data(), request.size(), grpc::Slice::STATIC_SLICE);
  const grpc::ByteBuffer wire(&slice, 1);
  grpc::ByteBuffer answer;
  grpc::Status status;
  switch (static_cast<WorkerRingKind>(kind)) {
    case WorkerRingKind::kForward:
      status = ForwardOnBytes(inner_, wire, &answer);
      break;
    case WorkerRingKind::kBackward:
      status = BackwardOnBytes(inner_, wire, &answer);
      break;
    case WorkerRingKind::kReleaseStep:
      status = ReleaseStepOnBytes(inner_, wire, &answer);
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("step ring record of unknown kind ", kind));
  }
  if (!status.ok()) return FromGrpcStatus(status);
  return BufferBytes(answer);
}

grpc::Status AuthenticatedWorkerService::OpenStepChannels(
    grpc::ServerContext* context, const internal::OpenStepChannelsRequest* request,
    internal::OpenStepChannelsResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  if (!denied.ok()) return denied;
  rings_.Open(*request, response);
  return grpc::Status::OK;
}

// One definition per row of MOE_WORKER_CHECKED_RPCS (authenticated_worker.h).
#define MOE_DEFINE_CHECKED_RPC(Method, Input, Output)                                        \
  grpc::Status AuthenticatedWorkerService::Method(grpc::ServerContext* context, Input input, \
                                                  Output output) {                           \
    grpc::Status denied = secret_.Check(*context);                                           \
    return denied.ok() ? inner_->Method(context, input, output) : denied;                    \
  }
MOE_WORKER_CHECKED_RPCS(MOE_DEFINE_CHECKED_RPC)
#undef MOE_DEFINE_CHECKED_RPC

}  // namespace moe
