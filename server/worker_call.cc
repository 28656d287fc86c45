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

absl::Status CheckWorkerMessageSizes(absl::string_view field, const std::vector<int64_t>& offsets,
                                     size_t row_bytes, int64_t limit) {
  for (size_t r = 0; r + 1 < offsets.size(); ++r) {
    const uint64_t rows = static_cast<uint64_t>(offsets[r + 1] - offsets[r]);
    // rows * row_bytes > limit, without the product (it may not fit 64 bits).
    if (row_bytes > 0 && rows > static_cast<uint64_t>(limit) / row_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          field, ": worker ", r, "'s ", rows, " rows are ",
          static_cast<double>(rows) * static_cast<double>(row_bytes) > 9e18
              ? std::string("over 2^63")
              : absl::StrCat(rows * row_bytes),
          " bytes, more than one gRPC message to a worker can carry (", limit,
          "); workers on moed's host take any size through its relay buffers (--shm_relay, "
          "--shm_relay_max_bytes at least the step's tensors), else split the step's tokens "
          "over more workers or more steps"));
    }
  }
  return absl::OkStatus();
}

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
