#include "server/coordinator_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"

namespace moe {

grpc::Status CoordinatorService::DoJoin(const internal::JoinRequest* request,
                                        internal::JoinResponse* response) {
  absl::StatusOr<internal::JoinResponse> joined = pool_->Join(*request);
  if (!joined.ok()) return ToGrpcStatus(joined.status());
  *response = *joined;
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* CoordinatorService::StoreSet(grpc::CallbackServerContext* context,
                                                       const internal::StoreSetRequest* request,
                                                       internal::StoreSetResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (request->key().empty()) {
    reactor->Finish(ToGrpcStatus(absl::InvalidArgumentError("key: required")));
  } else {
    reactor->Finish(ToGrpcStatus(store_->Set(request->key(), request->value())));
  }
  return reactor;
}

grpc::Status CoordinatorService::DoStoreGet(grpc::ServerContextBase* context,
                                            const internal::StoreGetRequest* request,
                                            internal::StoreGetResponse* response) {
  if (request->key().empty()) return ToGrpcStatus(absl::InvalidArgumentError("key: required"));
  absl::Duration timeout =
      absl::Milliseconds(std::clamp<int64_t>(request->timeout_ms(), 0, 600000));
  timeout = std::min(timeout, absl::FromChrono(context->deadline()) - absl::Now());
  const absl::Time give_up = absl::Now() + timeout;
  // Waits in slices so that a cancelled call (the worker gave up, or Server::Shutdown
  // cancelled it) frees its pool thread within one slice instead of at its timeout.
  constexpr absl::Duration kSlice = absl::Milliseconds(200);
  while (true) {
    const absl::Duration left = give_up - absl::Now();
    absl::StatusOr<std::string> value = store_->Get(request->key(), std::min(left, kSlice));
    if (value.ok()) {
      response->set_value(*value);
      return grpc::Status::OK;
    }
    if (value.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return ToGrpcStatus(value.status());
    }
    if (left <= kSlice) {
      return ToGrpcStatus(absl::DeadlineExceededError(
          absl::StrCat("key-value store: key '", request->key(), "' not set within ",
                       absl::FormatDuration(timeout))));
    }
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "StoreGet cancelled");
    }
  }
}

}  // namespace moe
