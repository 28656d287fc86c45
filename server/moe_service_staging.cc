// MoeServiceImpl: staged tensors (proto/moe.proto, "Staged tensors"; the book is
// server/staging.h). StageTensor copies a part's rows once, from the received slices into the
// tensor's relay buffer, on a handler thread (parts of one tensor copy in parallel);
// FetchStaged answers with slices of the kept output, inline (nothing to wait for or copy).
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/status_convert.h"
#include "proto/tensor_wire.h"
#include "server/auth.h"
#include "server/moe_service.h"

namespace moe {

grpc::ServerUnaryReactor* MoeServiceImpl::StageTensor(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* wire,
                                                      grpc::ByteBuffer* answer) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status allowed = Allow(*context, Role::kInfer);
  auto request = std::make_shared<v1::StageTensorRequest>();
  auto bytes = std::make_shared<TensorBytes>();
  if (allowed.ok()) {
    allowed = DecodeWithTensor(*wire, v1::StageTensorRequest::kRowsFieldNumber, request.get(),
                               bytes.get());
  }
  if (!allowed.ok()) {
    reactor->Finish(ToGrpcStatus(allowed));
    return reactor;
  }
  const std::string owner = ClientOf(*context);
  return RunUnary(
      context, &handlers_,
      [=] {
        const absl::Time start = absl::Now();
        absl::Status status = staging_->Stage(owner, request->name(), request->total_rows(),
                                              request->row_offset(), request->rows(), *bytes);
        if (status.ok()) *answer = EncodeMessage(v1::StageTensorResponse());
        return Finish("StageTensor", start, status);
      },
      owner);
}

grpc::ServerUnaryReactor* MoeServiceImpl::FetchStaged(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* wire,
                                                      grpc::ByteBuffer* answer) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  v1::FetchStagedRequest request;
  TensorBytes none;
  absl::Status status = Allow(*context, Role::kInfer);
  if (status.ok()) status = DecodeWithTensor(*wire, /*tensor_field=*/0, &request, &none);
  v1::Tensor head;
  std::vector<grpc::Slice> rows;
  if (status.ok()) {
    status = staging_->Fetch(ClientOf(*context), request.name(), request.row_offset(),
                             request.rows(), &head, &rows);
  }
  if (status.ok()) {
    *answer = EncodeWithTensor(v1::FetchStagedResponse(), v1::FetchStagedResponse::kRowsFieldNumber,
                               head, std::move(rows));
  }
  reactor->Finish(Finish("FetchStaged", start, status));
  return reactor;
}

absl::StatusOr<StagedStepInput> MoeServiceImpl::TakeStaged(const std::string& client,
                                                           const std::string& name,
                                                           int64_t hidden) {
  StagedStepInput input;
  ASSIGN_OR_RETURN(input.tensor, staging_->TakeInput(client, name, hidden));
  input.head.set_datatype(DTypeName(input.tensor.dtype));
  input.head.add_shape(input.tensor.rows);
  input.head.add_shape(input.tensor.hidden);
  input.bytes = TensorBytes(absl::string_view(input.tensor.buffer->data, input.tensor.bytes()));
  return input;
}

absl::Status MoeServiceImpl::CheckStagedOutput(const std::string& client,
                                               absl::string_view field, const std::string& name,
                                               bool has_shm_output) {
  if (name.empty()) return absl::OkStatus();
  if (has_shm_output) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": an output goes to a region or is staged, not both"));
  }
  return staging_->CheckOutputName(client, name);
}

absl::Status MoeServiceImpl::KeepStagedOutput(const std::string& client,
                                              const std::string& name, DType dtype, int64_t tokens,
                                              int64_t hidden, std::vector<grpc::Slice>* output) {
  std::vector<grpc::Slice> slices = std::move(*output);
  output->clear();
  return staging_->PutOutput(client, name, dtype, tokens, hidden, std::move(slices));
}

}  // namespace moe
