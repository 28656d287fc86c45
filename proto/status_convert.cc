#include "proto/status_convert.h"

#include <string>

namespace moe {
namespace {

// Both enums are the canonical google.rpc.Code; a code outside [0, 16] becomes UNKNOWN.
bool IsCanonical(int code) { return code >= 0 && code <= 16; }

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  int code = static_cast<int>(status.code());
  if (!IsCanonical(code)) code = static_cast<int>(grpc::StatusCode::UNKNOWN);
  return grpc::Status(static_cast<grpc::StatusCode>(code), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  int code = static_cast<int>(status.error_code());
  if (!IsCanonical(code)) code = static_cast<int>(absl::StatusCode::kUnknown);
  return absl::Status(static_cast<absl::StatusCode>(code), status.error_message());
}

}  // namespace moe
