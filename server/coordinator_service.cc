#include "server/coordinator_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"

namespace moe {
namespace {

// Finishes the call at once with `status`.
grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                    const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorService::Join(grpc::CallbackServerContext* context,
                                                   const internal::JoinRequest* request,
                                                   internal::JoinResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  if (!denied.ok()) return FinishNow(context, denied);
  return RunUnary(context, &handlers_, [=] { return DoJoin(request, response); });
}

grpc::ServerUnaryReactor* CoordinatorService::StoreSet(grpc::CallbackServerContext* context,
                                                       const internal::StoreSetRequest* request,
                                                       internal::StoreSetResponse*) {
  grpc::Status denied = secret_.Check(*context);
  if (!denied.ok()) return FinishNow(context, denied);
  return FinishNow(context, ToGrpcStatus(store_->Set(request->key(), request->value())));
}

grpc::ServerUnaryReactor* CoordinatorService::StoreGet(grpc::CallbackServerContext* context,
                                                       const internal::StoreGetRequest* request,
                                                       internal::StoreGetResponse* response) {
  grpc::Status denied = secret_.Check(*context);
  if (!denied.ok()) return FinishNow(context, denied);
  return RunUnary(context, &handlers_, [=] { return DoStoreGet(context, request, response); });
}

grpc::Status CoordinatorService::DoJoin(const internal::JoinRequest* request,
                                        internal::JoinResponse* response) {
  absl::StatusOr<internal::JoinResponse> joined = pool_->Join(*request);
  if (!joined.ok()) return ToGrpcStatus(joined.status());
  *response = *joined;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::DoStoreGet(grpc::ServerContextBase* context,
                                            const internal::StoreGetRequest* request,
                                            internal::StoreGetResponse* response) {
  absl::Duration timeout =
      absl::Milliseconds(std::clamp<int64_t>(request->timeout_ms(), 0, 600000));
  timeout = std::min(timeout, absl::FromChrono(context->deadline()) - absl::Now());
  absl::StatusOr<std::string> value = store_->Get(request->key(), timeout, context->peer(),
                                                  [context] { return context->IsCancelled(); });
  if (!value.ok()) return ToGrpcStatus(value.status());
  response->set_value(*std::move(value));
  return grpc::Status::OK;
}

}  // namespace moe
