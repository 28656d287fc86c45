#include "server/worker_call.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {

absl::Status CallWorker(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                        const char* method, const grpc::ByteBuffer& request,
                        google::protobuf::MessageLite* response) {
  grpc::ByteBuffer answer;
  RETURN_IF_ERROR(CallUnary(channel, context, method, request, &answer));
  grpc::ProtoBufferReader reader(&answer);
  if (!response->ParseFromZeroCopyStream(&reader)) {
    return absl::InternalError(absl::StrCat("could not parse the answer of ", method));
  }
  return absl::OkStatus();
}

}  // namespace moe
