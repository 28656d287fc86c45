#include "server/worker_call.h"

#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/status_convert.h"

namespace moe {
namespace {

// A slice that owns `bytes` (not copied).
grpc::Slice OwningSlice(std::string bytes) {
  auto* owned = new std::string(std::move(bytes));
  return grpc::Slice(
      owned->data(), owned->size(), [](void* p) { delete static_cast<std::string*>(p); }, owned);
}

// The call on the route's step rings: nullopt when it was not sent there (use gRPC).
std::optional<absl::Status> CallOnRing(const WorkerRoute& route, grpc::ClientContext* context,
                                       WorkerRingKind kind, const grpc::ByteBuffer& request,
                                       grpc::ByteBuffer* answer) {
  if (route.rings == nullptr) return std::nullopt;
  std::function<bool()> cancelled;
  if (route.cancelled) cancelled = [&] { return route.cancelled(context); };
  std::optional<absl::StatusOr<std::string>> bytes =
      route.rings->Call(kind, request, absl::FromChrono(context->deadline()), cancelled);
  if (!bytes.has_value()) return std::nullopt;
  if (!bytes->ok()) return bytes->status();
  grpc::Slice slice = OwningSlice(**std::move(bytes));
  *answer = grpc::ByteBuffer(&slice, 1);
  return absl::OkStatus();
}

}  // namespace

absl::Status CallWorkerWithTensor(const WorkerRoute& route, grpc::ClientContext* context,
                                  const char* method, const grpc::ByteBuffer& request,
                                  int tensor_field, google::protobuf::MessageLite* head,
                                  TensorBytes* bytes) {
  const WorkerRingKind kind = std::strcmp(method, kWorkerForwardMethod) == 0
                                  ? WorkerRingKind::kForward
                                  : WorkerRingKind::kBackward;
  grpc::ByteBuffer answer;
  std::optional<absl::Status> on_ring = CallOnRing(route, context, kind, request, &answer);
  if (on_ring.has_value()) {
    RETURN_IF_ERROR(*on_ring);
  } else {
    RETURN_IF_ERROR(CallUnary(route.channel, context, method, request, &answer));
  }
  absl::Status decoded = DecodeWithTensor(answer, tensor_field, head, bytes);
  if (!decoded.ok()) {
    return absl::InternalError(
        absl::StrCat("could not parse the answer of ", method, ": ", decoded.message()));
  }
  return absl::OkStatus();
}

absl::Status CallWorkerReleaseStep(const WorkerRoute& route, internal::Worker::Stub* stub,
                                   grpc::ClientContext* context,
                                   const internal::WorkerReleaseStepRequest& request) {
  grpc::ByteBuffer answer;
  std::optional<absl::Status> on_ring = CallOnRing(
      route, context, WorkerRingKind::kReleaseStep, EncodeMessage(request), &answer);
  if (on_ring.has_value()) return *on_ring;  // the answer is a WorkerEmpty
  internal::WorkerEmpty empty;
  return FromGrpcStatus(stub->ReleaseStep(context, request, &empty));
}

}  // namespace moe
