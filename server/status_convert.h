// absl::Status <-> grpc::Status at the service edge. The two code spaces are the same
// sixteen canonical codes with the same numbers; the conversion keeps code and message.
//
//   grpc::Status Forward(...) { return ToGrpcStatus(DoForward(...)); }
//   absl::Status s = FromGrpcStatus(stub->Ping(&ctx, req, &resp));
#ifndef MOED_SERVER_STATUS_CONVERT_H_
#define MOED_SERVER_STATUS_CONVERT_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace moe {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace moe

#endif  // MOED_SERVER_STATUS_CONVERT_H_
