// MoeServiceImpl on gRPC's callback API: the entry point of every RPC. Calls that may wait
// (a layer's turn, the workers) run their body on a HandlerPool thread (server/callback.h);
// ListLayers, GetLayer and GetStatus only read the front end's books and answer inline.
// Every call first checks the caller's role (server/auth.h; the table in server/README.md),
// before it takes a handler thread; a refused call is counted (moed_denied_total).
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/byte_buffer.h"
#include "proto/status_convert.h"
#include "server/auth.h"
#include "server/moe_service.h"
#include "transport/step_envelope.h"

namespace moe {

namespace {

// The fields of a raw step: its role, tensor, shared-memory and staged input fields, and its
// answer's tensor field.
template <typename Request>
struct RawStepFields;
template <>
struct RawStepFields<v1::ForwardRequest> {
  using Response = v1::ForwardResponse;
  static constexpr Role kRole = Role::kInfer;
  static constexpr int kTensor = v1::ForwardRequest::kXFieldNumber;
  static constexpr int kShm = v1::ForwardRequest::kXShmFieldNumber;
  static constexpr int kStaged = v1::ForwardRequest::kXStagedFieldNumber;
  static constexpr int kAnswer = v1::ForwardResponse::kOutFieldNumber;
  static v1::Tensor* ReleaseAnswer(Response* response) { return response->release_out(); }
};
template <>
struct RawStepFields<v1::BackwardRequest> {
  using Response = v1::BackwardResponse;
  static constexpr Role kRole = Role::kTrain;
  static constexpr int kTensor = v1::BackwardRequest::kDOutFieldNumber;
  static constexpr int kShm = v1::BackwardRequest::kDOutShmFieldNumber;
  static constexpr int kStaged = v1::BackwardRequest::kDOutStagedFieldNumber;
  static constexpr int kAnswer = v1::BackwardResponse::kDXFieldNumber;
  static v1::Tensor* ReleaseAnswer(Response* response) { return response->release_d_x(); }
};

// A step channel record's caller (server/step_caller.h): the identity captured at open, the
// envelope's deadline, cancelled once the channel closes or its caller exits.
class ChannelStepCaller final : public StepCaller {
 public:
  ChannelStepCaller(std::string peer, std::string client, absl::Time deadline,
                    const StepChannels::Cancelled& cancelled)
      : peer_(std::move(peer)), client_(std::move(client)), deadline_(deadline),
        cancelled_(cancelled) {}
  std::string peer() const override { return peer_; }
  const std::string& client() const override { return client_; }
  absl::Time deadline() const override { return deadline_; }
  bool cancelled() const override { return cancelled_(); }

 private:
  const std::string peer_;
  const std::string client_;
  const absl::Time deadline_;
  const StepChannels::Cancelled& cancelled_;
};

// Finishes a call on the callback thread that received it.
grpc::ServerUnaryReactor* FinishInline(grpc::CallbackServerContext* context,
                                       const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

}  // namespace

absl::Status MoeServiceImpl::Allow(const grpc::ServerContextBase& context, Role role) const {
  absl::Status allowed = Authorize(options_.auth, context, role);
  if (!allowed.ok()) {
    metrics_->CountDenied(std::string(RoleName(role)), static_cast<int>(allowed.code()));
  }
  return allowed;
}

std::string MoeServiceImpl::ClientOf(const grpc::ServerContextBase& context) const {
  if (options_.auth != nullptr) {
    // Only calls with a known token get this far: its hash names the client wherever it
    // connects from.
    const auto& metadata = context.client_metadata();
    auto it = metadata.find("authorization");
    if (it != metadata.end()) {
      return "token " + Sha256Hex(absl::string_view(it->second.data(), it->second.size()));
    }
  }
  return PeerHost(context);
}

// Checks the caller's role (server/auth.h) before the body is queued: a refused call never
// takes a handler thread.
template <typename Body>
grpc::ServerUnaryReactor* MoeServiceImpl::RunAuthorized(grpc::CallbackServerContext* context,
                                                        Role role, Body body) {
  absl::Status allowed = Allow(*context, role);
  if (!allowed.ok()) return FinishInline(context, ToGrpcStatus(allowed));
  return RunUnary(context, &handlers_, std::move(body), ClientOf(*context));
}

// A stream refused before its body takes a handler thread.
#define REFUSE_STREAM_IF_DENIED(Stream, role)                      \
  if (absl::Status allowed = Allow(*context, role); !allowed.ok()) \
  return Stream::Refuse(ToGrpcStatus(allowed))

grpc::ServerUnaryReactor* MoeServiceImpl::CreateLayer(grpc::CallbackServerContext* context,
                                                      const v1::CreateLayerRequest* request,
                                                      v1::CreateLayerResponse* response) {
  return RunAuthorized(context, Role::kAdmin,
                       [=] { return DoCreateLayer(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::DeleteLayer(grpc::CallbackServerContext* context,
                                                      const v1::DeleteLayerRequest* request,
                                                      v1::DeleteLayerResponse* response) {
  return RunAuthorized(context, Role::kAdmin,
                       [=] { return DoDeleteLayer(context, request, response); });
}

// Forward and Backward arrive raw (server/moe_service.h): the role check runs before the
// request is split (kInfer, then kTrain for a step to keep), the split before a handler
// thread is taken; a request that does not parse is INVALID_ARGUMENT, as protobuf would say.
template <typename Request>
absl::Status MoeServiceImpl::AdmitRawStep(const std::function<absl::Status(Role)>& allow,
                                          const grpc::ByteBuffer& wire, Request* request,
                                          TensorBytes* input) {
  using Fields = RawStepFields<Request>;
  RETURN_IF_ERROR(allow(Fields::kRole));
  absl::Status decoded =
      DecodeWithTensor(wire, Fields::kTensor, request, input, {Fields::kShm, Fields::kStaged});
  if (!decoded.ok()) return decoded;
  if constexpr (std::is_same_v<Request, v1::ForwardRequest>) {
    if (request->keep_for_backward()) return allow(Role::kTrain);
  }
  return absl::OkStatus();
}

template <typename Request>
grpc::Status MoeServiceImpl::AnswerRawStep(const StepCaller& caller, const Request& request,
                                           const TensorBytes& input, grpc::ByteBuffer* answer) {
  using Fields = RawStepFields<Request>;
  typename Fields::Response response;
  std::vector<grpc::Slice> output;
  grpc::Status status;
  if constexpr (std::is_same_v<Request, v1::ForwardRequest>) {
    status = DoForward(caller, request, input, &response, &output);
  } else {
    status = DoBackward(caller, request, input, &response, &output);
  }
  // A region unregistered while this step used it. Not after a failed step: its buffers were
  // discarded because a worker may not answer (stopped, cut off), and the caller's error must
  // not wait for that worker; the housekeeping thread forgets them within a second.
  if (status.ok()) {
    ForgetRetiredShm();
    // The answer's tensor (datatype and shape) goes last, around the workers' bytes.
    std::unique_ptr<v1::Tensor> head(Fields::ReleaseAnswer(&response));
    *answer = EncodeWithTensor(response, Fields::kAnswer, head ? *head : v1::Tensor(),
                               std::move(output));
  }
  return status;
}

template <typename Request>
grpc::ServerUnaryReactor* MoeServiceImpl::RunRawStep(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* wire,
                                                     grpc::ByteBuffer* answer) {
  auto request = std::make_shared<Request>();
  auto input = std::make_shared<TensorBytes>();
  absl::Status admitted = AdmitRawStep(
      [&](Role role) { return Allow(*context, role); }, *wire, request.get(), input.get());
  if (!admitted.ok()) return FinishInline(context, ToGrpcStatus(admitted));
  const std::string client = ClientOf(*context);
  return RunUnary(
      context, &handlers_,
      [=] { return AnswerRawStep(GrpcStepCaller(context, client), *request, *input, answer); },
      client);
}

grpc::ServerUnaryReactor* MoeServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  return RunRawStep<v1::ForwardRequest>(context, request, response);
}

grpc::ServerUnaryReactor* MoeServiceImpl::Backward(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return RunRawStep<v1::BackwardRequest>(context, request, response);
}

absl::StatusOr<std::string> MoeServiceImpl::AnswerStepRecord(
    const ChannelIdentity& who, absl::string_view record,
    const StepChannels::Cancelled& cancelled) {
  ASSIGN_OR_RETURN(const StepEnvelope envelope, DecodeStepEnvelope(record));
  const ChannelStepCaller caller(who.peer, who.client, absl::Now() + envelope.deadline, cancelled);
  auto allow = [&](Role role) { return AllowChannel(who, role); };
  const grpc::ByteBuffer wire = ByteBufferOf(envelope.body.data(), envelope.body.size());
  grpc::ByteBuffer answer;
  grpc::Status status;
  switch (static_cast<StepRecordKind>(envelope.kind)) {
    case StepRecordKind::kForward:
    case StepRecordKind::kBackward: {
      v1::ForwardRequest forward;
      v1::BackwardRequest backward;
      TensorBytes input;
      const bool is_forward = envelope.kind == static_cast<uint8_t>(StepRecordKind::kForward);
      RETURN_IF_ERROR(is_forward ? AdmitRawStep(allow, wire, &forward, &input)
                                 : AdmitRawStep(allow, wire, &backward, &input));
      // On the channel's own thread, in a handler slot (--handler_threads still bounds moed):
      // no hand-off to a pool thread and back per record.
      status = handlers_.RunHere(who.client, [&] {
        return is_forward ? AnswerRawStep(caller, forward, input, &answer)
                          : AnswerRawStep(caller, backward, input, &answer);
      });
      break;
    }
    case StepRecordKind::kReleaseStep: {
      RETURN_IF_ERROR(allow(Role::kTrain));
      v1::ReleaseStepRequest request;
      if (!request.ParseFromArray(envelope.body.data(), static_cast<int>(envelope.body.size()))) {
        return absl::InvalidArgumentError("ReleaseStepRequest: does not parse");
      }
      v1::ReleaseStepResponse response;
      status = handlers_.RunHere(who.client,
                                 [&] { return DoReleaseStep(caller, &request, &response); });
      if (status.ok()) return response.SerializeAsString();
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("step record: kind ", envelope.kind, " is not Forward (1), Backward (2) "
                       "or ReleaseStep (3)"));
  }
  if (!status.ok()) return FromGrpcStatus(status);
  return FlattenByteBuffer(answer);
}

grpc::ServerUnaryReactor* MoeServiceImpl::ReleaseStep(grpc::CallbackServerContext* context,
                                                      const v1::ReleaseStepRequest* request,
                                                      v1::ReleaseStepResponse* response) {
  return RunAuthorized(context, Role::kTrain, [=] {
    return DoReleaseStep(GrpcStepCaller(context, ClientOf(*context)), request, response);
  });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* MoeServiceImpl::ForwardStream(
    grpc::CallbackServerContext* context) {
  using Stream = RawStepStream;
  // kInfer before a byte is read; kTrain as well once the first message asks to keep the
  // step (DoForwardStream).
  REFUSE_STREAM_IF_DENIED(Stream, Role::kInfer);
  return Stream::Start(
      &handlers_, [=](Stream* stream) { return DoForwardStream(context, stream); },
      ClientOf(*context));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* MoeServiceImpl::BackwardStream(
    grpc::CallbackServerContext* context) {
  using Stream = RawStepStream;
  REFUSE_STREAM_IF_DENIED(Stream, Role::kTrain);
  return Stream::Start(
      &handlers_, [=](Stream* stream) { return DoBackwardStream(context, stream); },
      ClientOf(*context));
}

grpc::ServerUnaryReactor* MoeServiceImpl::ZeroGradients(grpc::CallbackServerContext* context,
                                                        const v1::ZeroGradientsRequest* request,
                                                        v1::ZeroGradientsResponse* response) {
  return RunAuthorized(context, Role::kTrain,
                       [=] { return DoZeroGradients(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ApplyOptimizer(grpc::CallbackServerContext* context,
                                                         const v1::ApplyOptimizerRequest* request,
                                                         v1::ApplyOptimizerResponse* response) {
  return RunAuthorized(context, Role::kTrain,
                       [=] { return DoApplyOptimizer(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::UpdateExpertBias(
    grpc::CallbackServerContext* context, const v1::UpdateExpertBiasRequest* request,
    v1::UpdateExpertBiasResponse* response) {
  return RunAuthorized(context, Role::kTrain,
                       [=] { return DoUpdateExpertBias(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::SaveCheckpoint(grpc::CallbackServerContext* context,
                                                         const v1::SaveCheckpointRequest* request,
                                                         v1::SaveCheckpointResponse* response) {
  return RunAuthorized(context, Role::kAdmin,
                       [=] { return DoSaveCheckpoint(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::LoadCheckpoint(grpc::CallbackServerContext* context,
                                                         const v1::LoadCheckpointRequest* request,
                                                         v1::LoadCheckpointResponse* response) {
  return RunAuthorized(context, Role::kAdmin,
                       [=] { return DoLoadCheckpoint(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::ListLayers(grpc::CallbackServerContext* context,
                                                     const v1::ListLayersRequest* request,
                                                     v1::ListLayersResponse* response) {
  absl::Status allowed = Allow(*context, Role::kRead);
  if (!allowed.ok()) return FinishInline(context, ToGrpcStatus(allowed));
  return FinishInline(context, DoListLayers(context, request, response));
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetLayer(grpc::CallbackServerContext* context,
                                                   const v1::GetLayerRequest* request,
                                                   v1::GetLayerResponse* response) {
  absl::Status allowed = Allow(*context, Role::kRead);
  if (!allowed.ok()) return FinishInline(context, ToGrpcStatus(allowed));
  return FinishInline(context, DoGetLayer(context, request, response));
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetStatus(grpc::CallbackServerContext* context,
                                                    const v1::GetStatusRequest* request,
                                                    v1::GetStatusResponse* response) {
  absl::Status allowed = Allow(*context, Role::kRead);
  if (!allowed.ok()) return FinishInline(context, ToGrpcStatus(allowed));
  return FinishInline(context, DoGetStatus(context, request, response));
}

grpc::ServerWriteReactor<v1::TensorChunk>* MoeServiceImpl::GetGradients(
    grpc::CallbackServerContext* context, const v1::GetGradientsRequest* request) {
  using Stream = StreamWriter<v1::TensorChunk>;
  REFUSE_STREAM_IF_DENIED(Stream, Role::kTrain);
  return Stream::Start(
      &handlers_, [=](Stream* writer) { return DoGetGradients(context, request, writer); },
      ClientOf(*context));
}

grpc::ServerWriteReactor<v1::TensorChunk>* MoeServiceImpl::GetWeights(
    grpc::CallbackServerContext* context, const v1::GetWeightsRequest* request) {
  using Stream = StreamWriter<v1::TensorChunk>;
  REFUSE_STREAM_IF_DENIED(Stream, Role::kRead);
  return Stream::Start(
      &handlers_, [=](Stream* writer) { return DoGetWeights(context, request, writer); },
      ClientOf(*context));
}

grpc::ServerReadReactor<v1::SetWeightsRequest>* MoeServiceImpl::SetWeights(
    grpc::CallbackServerContext* context, v1::SetWeightsResponse* response) {
  using Stream = StreamReader<v1::SetWeightsRequest>;
  REFUSE_STREAM_IF_DENIED(Stream, Role::kAdmin);
  return Stream::Start(
      &handlers_, [=](Stream* reader) { return DoSetWeights(context, reader, response); },
      ClientOf(*context));
}

grpc::ServerUnaryReactor* MoeServiceImpl::RegisterSystemSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSystemSharedMemoryRequest* request,
    v1::RegisterSystemSharedMemoryResponse* response) {
  return RunAuthorized(context, Role::kInfer,
                       [=] { return DoRegisterSystemSharedMemory(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context, const v1::SystemSharedMemoryStatusRequest* request,
    v1::SystemSharedMemoryStatusResponse* response) {
  return RunAuthorized(context, Role::kInfer,
                       [=] { return DoSystemSharedMemoryStatus(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::UnregisterSystemSharedMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterSystemSharedMemoryRequest* request,
    v1::UnregisterSystemSharedMemoryResponse* response) {
  return RunAuthorized(context, Role::kInfer,
                       [=] { return DoUnregisterSystemSharedMemory(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::OpenStepChannel(grpc::CallbackServerContext* context,
                                                          const v1::OpenStepChannelRequest* request,
                                                          v1::OpenStepChannelResponse* response) {
  return RunAuthorized(context, Role::kInfer,
                       [=] { return DoOpenStepChannel(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::CloseStepChannel(
    grpc::CallbackServerContext* context, const v1::CloseStepChannelRequest* request,
    v1::CloseStepChannelResponse* response) {
  return RunAuthorized(context, Role::kInfer,
                       [=] { return DoCloseStepChannel(context, request, response); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::RegisterCudaSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterCudaSharedMemoryRequest* request,
    v1::RegisterCudaSharedMemoryResponse* response) {
  return RunAuthorized(context, Role::kInfer,
                       [=] { return DoRegisterCudaSharedMemory(context, request, response); });
}

}  // namespace moe
