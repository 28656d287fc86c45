#include "client/moe_client.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/phase_clock.h"
#include "client/step_stream.h"
#include "engine/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/byte_buffer.h"
#include "proto/status_convert.h"
#include "proto/tensor_convert.h"
#include "proto/tensor_wire.h"
#include "transport/bulk_transport.h"

namespace moe {
namespace client {

int DefaultLanes(int cores) { return cores <= 2 ? 1 : std::min(cores, 16); }

namespace {

constexpr char kHealthCheckMethod[] = "/grpc.health.v1.Health/Check";
constexpr char kForwardMethod[] = "/moe.v1.MoeService/Forward";
constexpr char kBackwardMethod[] = "/moe.v1.MoeService/Backward";

// The RPC of a unary step and the tensor fields of its request and answer.
struct StepMethod {
  const char* method;
  int tensor_field;         // the request's tensor (x, d_out)
  int answer_tensor_field;  // the answer's tensor (out, d_x)
};
constexpr StepMethod kForwardStep = {kForwardMethod, v1::ForwardRequest::kXFieldNumber,
                                     v1::ForwardResponse::kOutFieldNumber};
constexpr StepMethod kBackwardStep = {kBackwardMethod, v1::BackwardRequest::kDOutFieldNumber,
                                      v1::BackwardResponse::kDXFieldNumber};

// grpc.health.v1.HealthCheckRequest {string service = 1;} encoded by hand: the Health protos
// are not installed with Debian's gRPC, and two lines of wire format beat vendoring them.
std::string EncodeHealthRequest(const std::string& service) {
  std::string out;
  if (service.empty()) return out;
  out.push_back(0x0a);  // field 1, length-delimited
  uint64_t n = service.size();
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out + service;
}

// HealthCheckResponse {ServingStatus status = 1;}: field 1 varint; other fields are skipped.
absl::StatusOr<ServingStatus> DecodeHealthResponse(const std::string& bytes) {
  size_t pos = 0;
  const auto varint = [&](uint64_t* value) {
    *value = 0;
    for (int shift = 0; pos < bytes.size() && shift < 64; shift += 7) {
      const uint8_t b = static_cast<uint8_t>(bytes[pos++]);
      *value |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  uint64_t status = 0;
  while (pos < bytes.size()) {
    uint64_t key = 0, value = 0;
    if (!varint(&key)) break;
    const int wire_type = static_cast<int>(key & 7);
    if (wire_type == 0) {
      if (!varint(&value)) break;
      if ((key >> 3) == 1) status = value;
    } else if (wire_type == 2) {
      if (!varint(&value) || pos + value > bytes.size()) break;
      pos += value;
    } else {
      return absl::InternalError("malformed grpc.health.v1.HealthCheckResponse");
    }
  }
  if (pos != bytes.size()) return absl::InternalError("malformed HealthCheckResponse");
  return status <= 3 ? static_cast<ServingStatus>(status) : ServingStatus::kUnknown;
}

// "c" + 16 random hex digits: staged names of different client objects of one caller (the
// same token or host) do not collide.
std::string RandomStagedPrefix() {
  std::random_device random;
  const uint64_t bits = (static_cast<uint64_t>(random()) << 32) ^ random();
  return absl::StrCat("c", absl::Hex(bits, absl::kZeroPad16));
}

}  // namespace

const char* ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    default:
      return "UNKNOWN";
  }
}

absl::StatusOr<std::unique_ptr<MoeClient>> MoeClient::Connect(const std::string& target,
                                                              ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target: empty server address");
  if (options.default_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("default_deadline must be positive");
  }
  grpc::ChannelArguments args;
  // Accepts what moed sends (each message at most its own --max_message_bytes).
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  SetBulkTransportArgs(&args);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
      !options.tls_key_file.empty()) {
    if (options.tls_ca_file.empty()) {
      return absl::InvalidArgumentError("TLS: a client certificate needs tls_ca_file as well");
    }
    if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("TLS: give both tls_cert_file and tls_key_file, or none");
    }
    grpc::SslCredentialsOptions ssl;
    auto read = [](const char* what, const std::string& path) -> absl::StatusOr<std::string> {
      std::ifstream in(path, std::ios::binary);
      if (!in) return absl::NotFoundError(absl::StrCat(what, ": cannot read ", path));
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    ASSIGN_OR_RETURN(ssl.pem_root_certs, read("tls_ca_file", options.tls_ca_file));
    if (!options.tls_cert_file.empty()) {
      ASSIGN_OR_RETURN(ssl.pem_cert_chain, read("tls_cert_file", options.tls_cert_file));
      ASSIGN_OR_RETURN(ssl.pem_private_key, read("tls_key_file", options.tls_key_file));
    }
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to ", target));
  }
  // Lanes: channels whose arguments differ get connections of their own.
  if (options.lanes <= 0) {
    options.lanes = DefaultLanes(static_cast<int>(std::thread::hardware_concurrency()));
  }
  std::vector<std::shared_ptr<grpc::Channel>> lanes;
  for (int i = 0; options.lanes > 1 && i < options.lanes; ++i) {
    grpc::ChannelArguments lane_args = args;
    lane_args.SetInt("moed.client.lane", i);
    lanes.push_back(grpc::CreateCustomChannel(target, credentials, lane_args));
  }
  return std::unique_ptr<MoeClient>(
      new MoeClient(target, options, std::move(channel), std::move(lanes)));
}

MoeClient::MoeClient(std::string target, ClientOptions options,
                     std::shared_ptr<grpc::Channel> channel,
                     std::vector<std::shared_ptr<grpc::Channel>> lanes)
    : target_(std::move(target)),
      options_(options),
      channel_(std::move(channel)),
      stub_(v1::MoeService::NewStub(channel_)),
      lanes_(std::move(lanes)),
      staged_prefix_(RandomStagedPrefix()) {
  if (options_.step_channel && IsLocalTarget(target_)) {
    step_channel_ = std::make_unique<ClientStepChannel>(stub_.get(), options_.token,
                                                        options_.step_channel_bytes,
                                                        options_.step_channel_spin);
  }
}

std::optional<absl::Status> MoeClient::MessageOnChannel(StepKind kind,
                                                        const google::protobuf::MessageLite& request,
                                                        const CallOptions& call,
                                                        google::protobuf::MessageLite* response) {
  if (step_channel_ == nullptr || !step_channel_->Fits(request.ByteSizeLong(), 4096)) {
    return std::nullopt;
  }
  std::optional<absl::StatusOr<std::string>> answer = step_channel_->Call(
      kind, request.SerializeAsString(), 4096, call.deadline.value_or(options_.default_deadline));
  if (!answer.has_value()) return std::nullopt;
  if (!answer->ok()) return answer->status();
  if (!response->ParseFromString(**answer)) {
    return absl::InternalError("bad answer from server on the step channel");
  }
  return absl::OkStatus();
}

bool MoeClient::NeedsStream(const Tensor& tensor) const {
  return static_cast<int64_t>(tensor.num_bytes()) + kStepMessageHeadroom >
         options_.max_message_bytes;
}

size_t MoeClient::PieceBytes() const {
  return static_cast<size_t>(
      std::max<int64_t>(options_.max_message_bytes - kStepMessageHeadroom, 4096));
}

void MoeClient::TakeForwardResults(v1::ForwardResponse* response, ForwardOutput* output) {
  output->aux_loss = response->aux_loss();
  output->z_loss = response->z_loss();
  output->tokens_per_expert.assign(response->tokens_per_expert().begin(),
                                   response->tokens_per_expert().end());
  output->step_id = response->step_id();
  output->load = std::move(*response->mutable_load());
}

void MoeClient::Prepare(const CallOptions& call, grpc::ClientContext* context) const {
  const absl::Duration timeout = call.deadline.value_or(options_.default_deadline);
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  context->set_wait_for_ready(call.wait_for_ready);
  if (!options_.token.empty()) context->AddMetadata("authorization", "Bearer " + options_.token);
}

// The unary calls all have the same shape: fill a request, call, map the status.
#define MOED_UNARY_CALL(method, request, response, call) \
  grpc::ClientContext context;                           \
  Prepare(call, &context);                               \
  RETURN_IF_ERROR(FromGrpcStatus(stub_->method(&context, request, &response)))

absl::StatusOr<v1::LayerInfo> MoeClient::CreateLayer(const std::string& name,
                                                     const v1::LayerConfig& config,
                                                     const CallOptions& call) {
  v1::CreateLayerRequest request;
  request.set_name(name);
  *request.mutable_config() = config;
  v1::CreateLayerResponse response;
  MOED_UNARY_CALL(CreateLayer, request, response, call);
  return std::move(*response.mutable_layer());
}

absl::Status MoeClient::DeleteLayer(const std::string& name, const CallOptions& call) {
  v1::DeleteLayerRequest request;
  request.set_name(name);
  v1::DeleteLayerResponse response;
  MOED_UNARY_CALL(DeleteLayer, request, response, call);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::LayerInfo>> MoeClient::ListLayers(const CallOptions& call) {
  v1::ListLayersRequest request;
  v1::ListLayersResponse response;
  MOED_UNARY_CALL(ListLayers, request, response, call);
  return std::vector<v1::LayerInfo>(response.layers().begin(), response.layers().end());
}

absl::StatusOr<v1::LayerInfo> MoeClient::GetLayer(const std::string& name,
                                                  const CallOptions& call) {
  v1::GetLayerRequest request;
  request.set_name(name);
  v1::GetLayerResponse response;
  MOED_UNARY_CALL(GetLayer, request, response, call);
  return std::move(*response.mutable_layer());
}

absl::StatusOr<ForwardOutput> MoeClient::Forward(const std::string& layer, const Tensor& x,
                                                 bool keep_for_backward, const CallOptions& call) {
  PhaseClock clock(call.timing != nullptr);
  v1::ForwardRequest request;
  request.set_layer(layer);
  request.set_keep_for_backward(keep_for_backward);
  request.set_timing(clock.enabled());
  request.set_unbatched(call.unbatched);
  if (call.output != nullptr) {
    RETURN_IF_ERROR(CheckTensorFits(kOutputName, *call.output, x.dtype(), x.shape()));
  }
  if (UsesLanes(x)) {
    bool sent = false;
    absl::StatusOr<ForwardOutput> output = ForwardOverLanes(request, x, call, &sent);
    if (sent) return output;  // else the server asked for x in the step
  }
  v1::ForwardResponse response;
  TensorBytes out_bytes;  // out's raw_data, where it arrived
  double encode_ms = 0.0;
  if (NeedsStream(x)) {
    grpc::ClientContext context;
    Prepare(call, &context);
    RETURN_IF_ERROR(StreamStep(channel_, &context, kForwardStreamMethod, request,
                               v1::ForwardRequest::kXFieldNumber, x,
                               v1::ForwardResponse::kOutFieldNumber, PieceBytes(), &response,
                               &out_bytes));
  } else {
    RETURN_IF_ERROR(
        CallStep(StepKind::kForward, request, x, call, &clock, &encode_ms, &response, &out_bytes));
  }
  const double call_ms = clock.Lap();
  ForwardOutput output;
  ASSIGN_OR_RETURN(output.out, TensorFromWire("ForwardResponse.out", response.out(), out_bytes,
                                                  call.output, kOutputName));
  if (call.timing != nullptr) {
    *call.timing =
        StepTimes{encode_ms, call_ms, clock.Lap(), std::move(*response.mutable_timing())};
  }
  TakeForwardResults(&response, &output);
  return output;
}

absl::StatusOr<Tensor> MoeClient::Backward(const std::string& layer, uint64_t step_id,
                                           const Tensor& d_out, std::optional<double> d_aux,
                                           std::optional<double> d_z_loss,
                                           const CallOptions& call) {
  PhaseClock clock(call.timing != nullptr);
  v1::BackwardRequest request;
  request.set_layer(layer);
  request.set_step_id(step_id);
  if (d_aux.has_value()) request.set_d_aux(*d_aux);
  if (d_z_loss.has_value()) request.set_d_z_loss(*d_z_loss);
  request.set_timing(clock.enabled());
  if (call.output != nullptr) {
    RETURN_IF_ERROR(CheckTensorFits(kOutputName, *call.output, d_out.dtype(), d_out.shape()));
  }
  if (UsesLanes(d_out)) {
    bool sent = false;
    absl::StatusOr<Tensor> d_x = BackwardOverLanes(request, d_out, call, &sent);
    if (sent) return d_x;
  }
  v1::BackwardResponse response;
  TensorBytes d_x_bytes;  // d_x's raw_data, where it arrived
  double encode_ms = 0.0;
  if (NeedsStream(d_out)) {
    grpc::ClientContext context;
    Prepare(call, &context);
    RETURN_IF_ERROR(StreamStep(channel_, &context, kBackwardStreamMethod, request,
                               v1::BackwardRequest::kDOutFieldNumber, d_out,
                               v1::BackwardResponse::kDXFieldNumber, PieceBytes(), &response,
                               &d_x_bytes));
  } else {
    RETURN_IF_ERROR(CallStep(StepKind::kBackward, request, d_out, call, &clock, &encode_ms,
                             &response, &d_x_bytes));
  }
  const double call_ms = clock.Lap();
  ASSIGN_OR_RETURN(Tensor d_x, TensorFromWire("BackwardResponse.d_x", response.d_x(), d_x_bytes,
                                               call.output, kOutputName));
  if (call.timing != nullptr) {
    *call.timing =
        StepTimes{encode_ms, call_ms, clock.Lap(), std::move(*response.mutable_timing())};
  }
  return d_x;
}

absl::Status MoeClient::CallStep(StepKind kind, const google::protobuf::MessageLite& head,
                                 const Tensor& tensor, const CallOptions& call, PhaseClock* clock,
                                 double* encode_ms, google::protobuf::MessageLite* answer,
                                 TensorBytes* answer_bytes) {
  const StepMethod& step = kind == StepKind::kForward ? kForwardStep : kBackwardStep;
  // Destroyed before the call returns: waits until gRPC let go of `tensor`'s bytes.
  BorrowedBytes borrowed;
  const grpc::ByteBuffer request = EncodeWithTensor(head, step.tensor_field, TensorHead(tensor),
                                                    borrowed.Borrow(tensor.bytes()));
  *encode_ms = clock->Lap();
  grpc::ByteBuffer wire;
  // On moed's host: one record on the step channel (its answer at most twice the tensor: a
  // BF16 d_out may answer an FP32 d_x), else the gRPC call.
  std::optional<absl::StatusOr<std::string>> ring;
  if (step_channel_ != nullptr && tensor.num_bytes() <= options_.step_channel_max_inline_bytes &&
      step_channel_->Fits(request.Length(), 2 * tensor.num_bytes())) {
    ring = step_channel_->Call(kind, FlattenByteBuffer(request), 2 * tensor.num_bytes(),
                               call.deadline.value_or(options_.default_deadline));
  }
  if (ring.has_value()) {
    RETURN_IF_ERROR(ring->status());
    wire = ByteBufferOf((*ring)->data(), (*ring)->size());
  } else {
    grpc::ClientContext context;
    Prepare(call, &context);
    RETURN_IF_ERROR(CallUnary(channel_, &context, step.method, request, &wire));
  }
  const absl::Status decoded =
      DecodeWithTensor(wire, step.answer_tensor_field, answer, answer_bytes);
  if (!decoded.ok()) {
    return absl::InternalError(
        absl::StrCat("bad answer from server to ", step.method, ": ", decoded.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> MoeClient::ReleaseStep(const std::string& layer, uint64_t step_id,
                                            const CallOptions& call) {
  v1::ReleaseStepRequest request;
  request.set_layer(layer);
  request.set_step_id(step_id);
  v1::ReleaseStepResponse response;
  if (std::optional<absl::Status> done =
          MessageOnChannel(StepKind::kReleaseStep, request, call, &response)) {
    RETURN_IF_ERROR(*done);
    return response.released();
  }
  MOED_UNARY_CALL(ReleaseStep, request, response, call);
  return response.released();
}

absl::StatusOr<std::vector<NamedTensor>> MoeClient::ReadChunks(
    grpc::ClientReaderInterface<v1::TensorChunk>* reader, grpc::ClientContext* context) {
  ChunkAssembler assembler;
  v1::TensorChunk chunk;
  absl::Status assembly = absl::OkStatus();
  while (reader->Read(&chunk)) {
    if (!assembly.ok()) continue;  // drain the stream so Finish() returns
    assembly = assembler.Add(chunk);
    if (!assembly.ok()) context->TryCancel();
  }
  const absl::Status rpc = FromGrpcStatus(reader->Finish());
  if (!assembly.ok()) {
    return absl::InternalError(absl::StrCat("bad chunk stream from server: ", assembly.message()));
  }
  RETURN_IF_ERROR(rpc);
  return assembler.Finish();
}

template <typename Request, typename Open>
absl::StatusOr<std::vector<NamedTensor>> MoeClient::ReadTensors(
    const std::string& layer, const std::vector<std::string>& names, const CallOptions& call,
    Open open) {
  Request request;
  request.set_layer(layer);
  for (const std::string& name : names) request.add_names(name);
  request.set_max_chunk_bytes(options_.chunk_bytes);
  grpc::ClientContext context;
  Prepare(call, &context);
  std::unique_ptr<grpc::ClientReader<v1::TensorChunk>> reader = open(&context, request);
  return ReadChunks(reader.get(), &context);
}

absl::StatusOr<std::vector<NamedTensor>> MoeClient::GetGradients(
    const std::string& layer, const std::vector<std::string>& names, const CallOptions& call) {
  return ReadTensors<v1::GetGradientsRequest>(
      layer, names, call, [this](grpc::ClientContext* context, const auto& request) {
        return stub_->GetGradients(context, request);
      });
}

absl::Status MoeClient::ZeroGradients(const std::string& layer, const CallOptions& call) {
  v1::ZeroGradientsRequest request;
  request.set_layer(layer);
  v1::ZeroGradientsResponse response;
  MOED_UNARY_CALL(ZeroGradients, request, response, call);
  return absl::OkStatus();
}

absl::Status MoeClient::ApplyOptimizer(const v1::ApplyOptimizerRequest& request,
                                       const CallOptions& call,
                                       v1::ApplyOptimizerResponse* answer) {
  v1::ApplyOptimizerResponse response;
  MOED_UNARY_CALL(ApplyOptimizer, request, response, call);
  if (answer != nullptr) *answer = std::move(response);
  return absl::OkStatus();
}

absl::Status MoeClient::ApplySgd(const std::string& layer, const v1::SgdOptimizer& sgd,
                                 const CallOptions& call, v1::ApplyOptimizerResponse* response,
                                 std::optional<int64_t> expected_optimizer_step) {
  v1::ApplyOptimizerRequest request;
  request.set_layer(layer);
  *request.mutable_sgd() = sgd;
  if (expected_optimizer_step) request.set_expected_optimizer_step(*expected_optimizer_step);
  return ApplyOptimizer(request, call, response);
}

absl::Status MoeClient::ApplyAdamW(const std::string& layer, const v1::AdamWOptimizer& adamw,
                                   const CallOptions& call, v1::ApplyOptimizerResponse* response,
                                   std::optional<int64_t> expected_optimizer_step) {
  v1::ApplyOptimizerRequest request;
  request.set_layer(layer);
  *request.mutable_adamw() = adamw;
  if (expected_optimizer_step) request.set_expected_optimizer_step(*expected_optimizer_step);
  return ApplyOptimizer(request, call, response);
}

absl::StatusOr<std::vector<float>> MoeClient::UpdateExpertBias(const std::string& layer,
                                                               double rate,
                                                               const CallOptions& call) {
  v1::UpdateExpertBiasRequest request;
  request.set_layer(layer);
  request.set_rate(rate);
  v1::UpdateExpertBiasResponse response;
  MOED_UNARY_CALL(UpdateExpertBias, request, response, call);
  return std::vector<float>(response.expert_bias().begin(), response.expert_bias().end());
}

absl::StatusOr<std::vector<NamedTensor>> MoeClient::GetWeights(
    const std::string& layer, const std::vector<std::string>& names, const CallOptions& call) {
  return ReadTensors<v1::GetWeightsRequest>(
      layer, names, call, [this](grpc::ClientContext* context, const auto& request) {
        return stub_->GetWeights(context, request);
      });
}

absl::StatusOr<std::vector<std::string>> MoeClient::SetWeights(
    const std::string& layer, const std::vector<NamedTensor>& tensors, const CallOptions& call) {
  grpc::ClientContext context;
  Prepare(call, &context);
  v1::SetWeightsResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::SetWeightsRequest>> writer =
      stub_->SetWeights(&context, &response);
  bool first = true;
  for (const NamedTensor& named : tensors) {
    const absl::Status written =
        ChunkTensor(named.name, named.tensor, options_.chunk_bytes, [&](v1::TensorChunk&& chunk) {
          v1::SetWeightsRequest request;
          if (first) request.set_layer(layer);
          first = false;
          *request.mutable_chunk() = std::move(chunk);
          // A failed Write means the server ended the call; Finish() says why.
          return writer->Write(request) ? absl::OkStatus()
                                        : absl::UnavailableError("server ended the stream");
        });
    if (!written.ok()) break;
  }
  if (first) {  // no tensors: still name the layer so the server can answer for it
    v1::SetWeightsRequest request;
    request.set_layer(layer);
    writer->Write(request);
  }
  writer->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
  return std::vector<std::string>(response.updated().begin(), response.updated().end());
}

absl::StatusOr<std::string> MoeClient::SaveCheckpoint(const std::string& layer,
                                                      const std::string& directory,
                                                      const CallOptions& call) {
  v1::SaveCheckpointRequest request;
  request.set_layer(layer);
  request.set_directory(directory);
  v1::SaveCheckpointResponse response;
  MOED_UNARY_CALL(SaveCheckpoint, request, response, call);
  return response.directory();
}

absl::Status MoeClient::LoadCheckpoint(const std::string& layer, const std::string& directory,
                                       const CallOptions& call) {
  v1::LoadCheckpointRequest request;
  request.set_layer(layer);
  request.set_directory(directory);
  v1::LoadCheckpointResponse response;
  MOED_UNARY_CALL(LoadCheckpoint, request, response, call);
  return absl::OkStatus();
}

absl::StatusOr<v1::GetStatusResponse> MoeClient::GetStatus(const CallOptions& call) {
  v1::GetStatusRequest request;
  v1::GetStatusResponse response;
  MOED_UNARY_CALL(GetStatus, request, response, call);
  return response;
}

#undef MOED_UNARY_CALL

absl::StatusOr<ServingStatus> MoeClient::Health(const std::string& service,
                                                const CallOptions& call) {
  grpc::GenericStub generic(channel_);
  grpc::ClientContext context;
  Prepare(call, &context);
  const std::string encoded = EncodeHealthRequest(service);
  grpc::Slice slice(encoded);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  absl::Notification done;
  generic.UnaryCall(&context, kHealthCheckMethod, grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
  done.WaitForNotification();
  RETURN_IF_ERROR(FromGrpcStatus(status));
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("cannot read health response");
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return DecodeHealthResponse(bytes);
}

}  // namespace client
}  // namespace moe
