// absl::Status <-> grpc::Status at the edge of every service and stub, server and client alike.
// The two code spaces are the same canonical codes 0-16 with the same numbers; the conversion
// keeps code and message (a code outside them becomes UNKNOWN).
//
//   grpc::Status Forward(...) { return ToGrpcStatus(DoForward(...)); }
//   absl::Status s = FromGrpcStatus(stub->Ping(&ctx, req, &resp));
#ifndef MOED_PROTO_STATUS_CONVERT_H_
#define MOED_PROTO_STATUS_CONVERT_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace moe {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace moe

#endif  // MOED_PROTO_STATUS_CONVERT_H_
