#include "server/coordinator_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/status_convert.h"

namespace moe {

grpc::Status CoordinatorService::Join(grpc::ServerContext*, const internal::JoinRequest* request,
                                      internal::JoinResponse* response) {
  absl::StatusOr<internal::JoinResponse> joined = pool_->Join(*request);
  if (!joined.ok()) return ToGrpcStatus(joined.status());
  *response = *joined;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::StoreSet(grpc::ServerContext*,
                                          const internal::StoreSetRequest* request,
                                          internal::StoreSetResponse*) {
  if (request->key().empty()) return ToGrpcStatus(absl::InvalidArgumentError("key: required"));
  return ToGrpcStatus(store_->Set(request->key(), request->value()));
}

grpc::Status CoordinatorService::StoreGet(grpc::ServerContext* context,
                                          const internal::StoreGetRequest* request,
                                          internal::StoreGetResponse* response) {
  if (request->key().empty()) return ToGrpcStatus(absl::InvalidArgumentError("key: required"));
  absl::Duration timeout =
      absl::Milliseconds(std::clamp<int64_t>(request->timeout_ms(), 0, 600000));
  timeout = std::min(timeout, absl::FromChrono(context->deadline()) - absl::Now());
  absl::StatusOr<std::string> value = store_->Get(request->key(), timeout);
  if (!value.ok()) return ToGrpcStatus(value.status());
  response->set_value(*value);
  return grpc::Status::OK;
}

}  // namespace moe
