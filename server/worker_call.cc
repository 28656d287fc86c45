#include "server/worker_call.h"

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {

absl::Status CallWorkerWithTensor(const std::shared_ptr<grpc::Channel>& channel,
                                  grpc::ClientContext* context, const char* method,
                                  const grpc::ByteBuffer& request, int tensor_field,
                                  google::protobuf::MessageLite* head, TensorBytes* bytes) {
  grpc::ByteBuffer answer;
  RETURN_IF_ERROR(CallUnary(channel, context, method, request, &answer));
  absl::Status decoded = DecodeWithTensor(answer, tensor_field, head, bytes);
  if (!decoded.ok()) {
    return absl::InternalError(
        absl::StrCat("could not parse the answer of ", method, ": ", decoded.message()));
  }
  return absl::OkStatus();
}

}  // namespace moe
