#include "server/grpc_kv_store.h"

#include <chrono>

#include "proto/status_convert.h"

namespace moe {

absl::Status GrpcKeyValueStore::Set(const std::string& key, const std::string& value) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  internal::StoreSetRequest request;
  request.set_key(key);
  request.set_value(value);
  internal::StoreSetResponse response;
  return FromGrpcStatus(stub_->StoreSet(&context, request, &response));
}

absl::StatusOr<std::string> GrpcKeyValueStore::Get(const std::string& key, absl::Duration timeout) {
  grpc::ClientContext context;
  // The server answers DEADLINE_EXCEEDED itself at `timeout`; the call deadline leaves room.
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout + absl::Seconds(5)));
  internal::StoreGetRequest request;
  request.set_key(key);
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  internal::StoreGetResponse response;
  absl::Status status = FromGrpcStatus(stub_->StoreGet(&context, request, &response));
  if (!status.ok()) return status;
  return response.value();
}

}  // namespace moe
