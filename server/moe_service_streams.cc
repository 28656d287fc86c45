// MoeServiceImpl: ForwardStream and BackwardStream, Forward and Backward for tensors larger
// than one message (proto/moe.proto). The request's tensor is assembled from its pieces, the
// step runs exactly as the unary call (DoForward / DoBackward: same validation, same bytes to
// the workers, so the results are bit-identical), and the answer's tensor goes back in pieces.
// The tensor's declared size is admitted against --max_stream_bytes (one step) and
// --max_inflight_bytes (all streamed steps at once) before its first piece is read.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"
#include "proto/status_convert.h"
#include "server/auth.h"
#include "server/moe_service.h"

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

// Reads the request stream into *request: the first message whole (check_first(it) must
// pass before more is read), then the pieces of the tensor `mutable_tensor` selects, appended
// to its raw_data. `max_bytes` bounds the declared size (moed assembles the tensor in memory).
// `admit(want)` reserves the declared size among all streamed steps before a piece is read.
template <typename Request, typename Response, typename CheckFirst, typename Admit>
absl::Status ReadPieces(StreamReaderWriter<Request, Response>* stream,
                        v1::Tensor* (Request::*mutable_tensor)(), absl::string_view field,
                        int64_t max_bytes, CheckFirst check_first, Admit admit, Request* request) {
  if (!stream->Read(request)) return absl::CancelledError("the stream ended before a request");
  RETURN_IF_ERROR(check_first(*request));
  v1::Tensor* tensor = (request->*mutable_tensor)();
  ASSIGN_OR_RETURN(const int64_t want, DeclaredBytes(field, *tensor));
  if (want > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        field, ": ", want, " bytes, more than one streamed step may hold in moed (limit ",
        "--max_stream_bytes=", max_bytes, ")"));
  }
  RETURN_IF_ERROR(admit(want));
  std::string* raw = tensor->mutable_raw_data();
  raw->reserve(want);
  Request piece;
  while (stream->Read(&piece)) {
    // A later message naming another layer, step or datatype would otherwise be appended to
    // the first one's tensor as if it were more of it.
    const std::vector<std::string> extra = FieldsBesidesThePiece(piece, field);
    if (!extra.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": a later message of the stream sets ", absl::StrJoin(extra, ", "),
          "; only the first message names the step, later ones carry only the next piece of ",
          field, ".raw_data"));
    }
    const std::string& bytes = (piece.*mutable_tensor)()->raw_data();
    if (static_cast<int64_t>(raw->size() + bytes.size()) > want) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".raw_data: the pieces carry more than the ", want, " bytes its shape declares"));
    }
    raw->append(bytes);
    piece.Clear();
  }
  // A short tensor is refused by the step's own validation, naming the field.
  return absl::OkStatus();
}

// The workers' answer bytes in one string (the answer goes out in pieces of its own size).
void JoinSlices(std::vector<grpc::Slice>* slices, std::string* out) {
  size_t total = 0;
  for (const grpc::Slice& slice : *slices) total += slice.size();
  out->reserve(total);
  for (grpc::Slice& slice : *slices) {
    out->append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    slice = grpc::Slice();  // the worker's bytes are freed as soon as they are copied
  }
}

// Sends *response with its tensor (`mutable_tensor`) split into pieces of at most
// piece_bytes: the first message carries every field and the first piece.
template <typename Request, typename Response>
absl::Status WritePieces(StreamReaderWriter<Request, Response>* stream,
                         v1::Tensor* (Response::*mutable_tensor)(), int64_t piece_bytes,
                         Response* response) {
  std::string all = std::move(*(response->*mutable_tensor)()->mutable_raw_data());
  const size_t piece = static_cast<size_t>(std::max<int64_t>(piece_bytes, 1));
  (response->*mutable_tensor)()->set_raw_data(all.data(), std::min(piece, all.size()));
  if (!stream->Write(*response)) return absl::CancelledError("client stopped reading");
  Response next;
  for (size_t offset = piece; offset < all.size(); offset += piece) {
    (next.*mutable_tensor)()->set_raw_data(all.data() + offset,
                                           std::min(piece, all.size() - offset));
    if (!stream->Write(next)) return absl::CancelledError("client stopped reading");
  }
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

grpc::Status MoeServiceImpl::DoForwardStream(
    grpc::ServerContextBase* context,
    StreamReaderWriter<v1::ForwardRequest, v1::ForwardResponse>* stream) {
  stream->CancelIfIdle(options_.stream_idle_timeout, context);
  v1::ForwardRequest request;
  // Keeping the step for a Backward needs the train role (as the unary Forward).
  auto may_keep = [&](const v1::ForwardRequest& first) {
    return first.keep_for_backward() ? Allow(*context, Role::kTrain) : absl::OkStatus();
  };
  int64_t held = 0;  // of max_inflight_bytes, until the step's answer is out
  absl::Cleanup release = [this, &held] { ReleaseInflightBytes(held); };
  auto admit = [&](int64_t bytes) { return HoldInflightBytes(bytes, &held); };
  absl::Status read = ReadPieces(stream, &v1::ForwardRequest::mutable_x, "x",
                                 options_.max_stream_bytes, may_keep, admit, &request);
  if (!read.ok()) return ToGrpcStatus(read);
  v1::ForwardResponse response;
  std::vector<grpc::Slice> out;
  grpc::Status step =
      DoForward(GrpcStepCaller(context, ClientOf(*context)), request,
                TensorBytes(request.x().raw_data()), &response, &out);
  if (!step.ok()) return step;
  request.Clear();  // x is no longer needed while the answer goes out
  JoinSlices(&out, response.mutable_out()->mutable_raw_data());
  return ToGrpcStatus(WritePieces(stream, &v1::ForwardResponse::mutable_out,
                                  options_.max_message_bytes - kPieceHeadroom, &response));
}

grpc::Status MoeServiceImpl::DoBackwardStream(
    grpc::ServerContextBase* context,
    StreamReaderWriter<v1::BackwardRequest, v1::BackwardResponse>* stream) {
  stream->CancelIfIdle(options_.stream_idle_timeout, context);
  v1::BackwardRequest request;
  int64_t held = 0;  // of max_inflight_bytes, until the step's answer is out
  absl::Cleanup release = [this, &held] { ReleaseInflightBytes(held); };
  auto admit = [&](int64_t bytes) { return HoldInflightBytes(bytes, &held); };
  absl::Status read = ReadPieces(
      stream, &v1::BackwardRequest::mutable_d_out, "d_out", options_.max_stream_bytes,
      [](const v1::BackwardRequest&) { return absl::OkStatus(); }, admit, &request);
  if (!read.ok()) return ToGrpcStatus(read);
  v1::BackwardResponse response;
  std::vector<grpc::Slice> d_x;
  grpc::Status step =
      DoBackward(GrpcStepCaller(context, ClientOf(*context)), request,
                 TensorBytes(request.d_out().raw_data()), &response, &d_x);
  if (!step.ok()) return step;
  request.Clear();
  JoinSlices(&d_x, response.mutable_d_x()->mutable_raw_data());
  return ToGrpcStatus(WritePieces(stream, &v1::BackwardResponse::mutable_d_x,
                                  options_.max_message_bytes - kPieceHeadroom, &response));
}

}  // namespace moe
