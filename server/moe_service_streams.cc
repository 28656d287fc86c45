// MoeServiceImpl: ForwardStream and BackwardStream, Forward and Backward for tensors larger
// than one message (proto/moe.proto). Raw like the unary Forward: the request's tensor is the
// received pieces joined by reference (never copied, parsed or serialised in moed), the step
// runs exactly as the unary call (DoForward / DoBackward: same validation, same bytes to the
// workers, so the results are bit-identical), and the answer's tensor goes back in pieces that
// reference the workers' output.
// The tensor's declared size is admitted against --max_stream_bytes (one step) and
// --max_inflight_bytes (all streamed steps at once) before its first piece is read.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"
#include "proto/status_convert.h"
#include "server/auth.h"
#include "proto/tensor_wire.h"
#include "server/moe_service.h"
#include "server/staging.h"

namespace moe {
namespace {

// Room left in each message for the fields around a piece.
constexpr int64_t kPieceHeadroom = int64_t{64} << 10;

// The byte count `tensor`'s datatype and shape declare; INVALID_ARGUMENT naming `field` for an
// unknown datatype or a negative or overflowing shape.
absl::StatusOr<int64_t> DeclaredBytes(absl::string_view field, const v1::Tensor& tensor) {
  absl::StatusOr<DType> dtype = ParseDType(tensor.datatype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".datatype: unknown datatype \"", tensor.datatype(), "\""));
  }
  int64_t bytes = static_cast<int64_t>(DTypeSize(*dtype));
  for (int64_t d : tensor.shape()) {
    if (d < 0 || (d > 0 && bytes > INT64_MAX / d)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape: invalid dimension ", d));
    }
    bytes *= d;
  }
  return bytes;
}

// The fields a later message of a request stream sets besides its piece of `field`'s raw_data
// ("layer", "x.datatype"); empty when it sets none (proto/moe.proto: every other field unset).
std::vector<std::string> FieldsBesidesThePiece(const google::protobuf::Message& piece,
                                               absl::string_view field) {
  std::vector<std::string> names;
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  piece.GetReflection()->ListFields(piece, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    if (f->name() != field || f->message_type() != v1::Tensor::descriptor()) {
      names.push_back(f->name());
      continue;
    }
    const google::protobuf::Message& tensor = piece.GetReflection()->GetMessage(piece, f);
    std::vector<const google::protobuf::FieldDescriptor*> inner;
    tensor.GetReflection()->ListFields(tensor, &inner);
    for (const google::protobuf::FieldDescriptor* g : inner) {
      if (g->name() != "raw_data") names.push_back(absl::StrCat(field, ".", g->name()));
    }
  }
  return names;
}

// The fields of one step's stream (ForwardStream: x and out; BackwardStream: d_out and d_x).
template <typename Request, typename Response>
struct StreamFields {
  const char* field;  // the request tensor's name ("x", "d_out")
  int tensor;         // its field number
  int shm, staged;  // the other members of its oneof
  const v1::Tensor& (Request::*tensor_of)() const;
  int answer;  // the answer tensor's field number
  v1::Tensor* (Response::*release_answer)();
};

const StreamFields<v1::ForwardRequest, v1::ForwardResponse> kForwardStream = {
    "x",
    v1::ForwardRequest::kXFieldNumber,
    v1::ForwardRequest::kXShmFieldNumber,
    v1::ForwardRequest::kXStagedFieldNumber,
    &v1::ForwardRequest::x,
    v1::ForwardResponse::kOutFieldNumber,
    &v1::ForwardResponse::release_out};
const StreamFields<v1::BackwardRequest, v1::BackwardResponse> kBackwardStream = {
    "d_out",
    v1::BackwardRequest::kDOutFieldNumber,
    v1::BackwardRequest::kDOutShmFieldNumber,
    v1::BackwardRequest::kDOutStagedFieldNumber,
    &v1::BackwardRequest::d_out,
    v1::BackwardResponse::kDXFieldNumber,
    &v1::BackwardResponse::release_d_x};

// Reads the request stream: the first message whole into *request (check_first(it) must pass
// before more is read), then the pieces of the tensor's raw_data, each split around its bytes
// as it arrives (DecodeWithTensor: the other fields parsed, the bytes left in the received
// slices); *tensor_bytes joins them as references (no byte copied). `max_bytes` bounds the
// declared size (moed holds the tensor in memory); `admit(want)` reserves the declared size
// among all streamed steps before a piece is read.
template <typename Request, typename Response, typename CheckFirst, typename Admit>
absl::Status ReadPieces(RawStepStream* stream, const StreamFields<Request, Response>& fields,
                        int64_t max_bytes, CheckFirst check_first, Admit admit, Request* request,
                        TensorBytes* tensor_bytes) {
  grpc::ByteBuffer wire;
  if (!stream->Read(&wire)) return absl::CancelledError("the stream ended before a request");
  std::vector<TensorBytes> parts(1);
  RETURN_IF_ERROR(DecodeWithTensor(wire, fields.tensor, request, &parts[0], {fields.shm, fields.staged}));
  RETURN_IF_ERROR(check_first(*request));
  ASSIGN_OR_RETURN(const int64_t want,
                   DeclaredBytes(fields.field, ((*request).*fields.tensor_of)()));
  if (want > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        fields.field, ": ", want, " bytes, more than one streamed step may hold in moed (limit ",
        "--max_stream_bytes=", max_bytes, ")"));
  }
  RETURN_IF_ERROR(admit(want));
  int64_t received = static_cast<int64_t>(parts[0].size());
  while (stream->Read(&wire)) {
    Request piece;
    TensorBytes bytes;
    RETURN_IF_ERROR(DecodeWithTensor(wire, fields.tensor, &piece, &bytes, {fields.shm, fields.staged}));
    // A later message naming another layer, step or datatype would otherwise be appended to
    // the first one's tensor as if it were more of it.
    const std::vector<std::string> extra = FieldsBesidesThePiece(piece, fields.field);
    if (!extra.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          fields.field, ": a later message of the stream sets ", absl::StrJoin(extra, ", "),
          "; only the first message names the step, later ones carry only the next piece of ",
          fields.field, ".raw_data"));
    }
    if (received + static_cast<int64_t>(bytes.size()) > want) {
      return absl::InvalidArgumentError(absl::StrCat(fields.field,
                                                     ".raw_data: the pieces carry more than the ",
                                                     want, " bytes its shape declares"));
    }
    received += static_cast<int64_t>(bytes.size());
    parts.push_back(std::move(bytes));
  }
  *tensor_bytes = TensorBytes::Concat(parts);
  // A short tensor is refused by the step's own validation, naming the field.
  return absl::OkStatus();
}

// Sends *response with its answer tensor (datatype and shape in *response, bytes = the
// concatenation of `bytes`) in pieces of at most piece_bytes: the first message carries every
// field and the first piece. Every piece references `bytes` (nothing copied or serialised).
template <typename Request, typename Response>
absl::Status WritePieces(RawStepStream* stream, const StreamFields<Request, Response>& fields,
                         int64_t piece_bytes, Response* response,
                         const std::vector<grpc::Slice>& bytes) {
  std::unique_ptr<v1::Tensor> head(((*response).*fields.release_answer)());
  if (head == nullptr) head = std::make_unique<v1::Tensor>();
  head->clear_raw_data();
  size_t total = 0;
  for (const grpc::Slice& slice : bytes) total += slice.size();
  const size_t piece = static_cast<size_t>(std::max<int64_t>(piece_bytes, 1));
  size_t offset = 0;
  do {
    const size_t length = std::min(piece, total - offset);
    std::vector<grpc::Slice> slices;
    AppendSubSlices(bytes, offset, length, &slices);
    const grpc::ByteBuffer wire =
        offset == 0 ? EncodeWithTensor(*response, fields.answer, *head, std::move(slices))
                    : EncodeWithTensor(Response(), fields.answer, v1::Tensor(), std::move(slices));
    if (!stream->Write(wire)) return absl::CancelledError("client stopped reading");
    offset += length;
  } while (offset < total);
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeServiceImpl::HoldInflightBytes(int64_t bytes, int64_t* held) {
  absl::MutexLock lock(&stream_mu_);
  // One step alone is always admitted (--max_stream_bytes bounds it).
  if (inflight_bytes_ > 0 && bytes > options_.max_inflight_bytes - inflight_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a streamed step of ", bytes, " bytes while streamed steps being assembled hold ",
        inflight_bytes_, " bytes (limit --max_inflight_bytes=", options_.max_inflight_bytes,
        "); retry later"));
  }
  inflight_bytes_ += bytes;
  *held = bytes;
  return absl::OkStatus();
}

void MoeServiceImpl::ReleaseInflightBytes(int64_t bytes) {
  absl::MutexLock lock(&stream_mu_);
  inflight_bytes_ -= bytes;
}

grpc::Status MoeServiceImpl::DoForwardStream(grpc::ServerContextBase* context,
                                             RawStepStream* stream) {
  stream->CancelIfIdle(options_.stream_idle_timeout, context);
  v1::ForwardRequest request;
  // Keeping the step for a Backward needs the train role (as the unary Forward).
  auto may_keep = [&](const v1::ForwardRequest& first) {
    return first.keep_for_backward() ? Allow(*context, Role::kTrain) : absl::OkStatus();
  };
  int64_t held = 0;  // of max_inflight_bytes, until the step's answer is out
  absl::Cleanup release = [this, &held] { ReleaseInflightBytes(held); };
  auto admit = [&](int64_t bytes) { return HoldInflightBytes(bytes, &held); };
  TensorBytes x;
  absl::Status read = ReadPieces(stream, kForwardStream, options_.max_stream_bytes, may_keep,
                                 admit, &request, &x);
  if (!read.ok()) return ToGrpcStatus(read);
  v1::ForwardResponse response;
  std::vector<grpc::Slice> out;
  grpc::Status step =
      DoForward(GrpcStepCaller(context, ClientOf(*context)), request, x, &response, &out);
  if (!step.ok()) return step;
  x = TensorBytes();  // the received pieces are no longer needed while the answer goes out
  return ToGrpcStatus(WritePieces(stream, kForwardStream,
                                  options_.max_message_bytes - kPieceHeadroom, &response, out));
}

grpc::Status MoeServiceImpl::DoBackwardStream(grpc::ServerContextBase* context,
                                              RawStepStream* stream) {
  stream->CancelIfIdle(options_.stream_idle_timeout, context);
  v1::BackwardRequest request;
  int64_t held = 0;  // of max_inflight_bytes, until the step's answer is out
  absl::Cleanup release = [this, &held] { ReleaseInflightBytes(held); };
  auto admit = [&](int64_t bytes) { return HoldInflightBytes(bytes, &held); };
  TensorBytes d_out;
  absl::Status read = ReadPieces(
      stream, kBackwardStream, options_.max_stream_bytes,
      [](const v1::BackwardRequest&) { return absl::OkStatus(); }, admit, &request, &d_out);
  if (!read.ok()) return ToGrpcStatus(read);
  v1::BackwardResponse response;
  std::vector<grpc::Slice> d_x;
  grpc::Status step =
      DoBackward(GrpcStepCaller(context, ClientOf(*context)), request, d_out, &response, &d_x);
  if (!step.ok()) return step;
  d_out = TensorBytes();
  return ToGrpcStatus(WritePieces(stream, kBackwardStream,
                                  options_.max_message_bytes - kPieceHeadroom, &response, d_x));
}

}  // namespace moe
