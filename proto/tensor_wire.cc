#include "proto/tensor_wire.h"

#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "proto/status_convert.h"
#include "proto/tensor_convert.h"

namespace moe {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;

constexpr int kRawDataField = 3;  // moe.v1.Tensor.raw_data

// TensorBytes::piece_slice_ for a piece in none of the received slices: a view of caller-owned
// bytes (lent through BorrowedBytes), or a piece a decoder found elsewhere (copied; not seen
// with protobuf's CodedInputStream, which reads the slices in place).
constexpr int kBorrowPiece = -1;
constexpr int kCopyPiece = -2;

void AppendTag(int field, CodedOutputStream* out) {
  out->WriteTag(WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
}

// The received slices as one stream, read in place (protobuf's parser reads a ByteBuffer
// the same way through grpc::ProtoBufferReader; this one keeps no reader state to outlive).
class SliceInputStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit SliceInputStream(const std::vector<grpc::Slice>* slices) : slices_(slices) {}

  bool Next(const void** data, int* size) override {
    if (backed_up_ > 0) {  // the tail of the current slice again
      const grpc::Slice& slice = (*slices_)[index_ - 1];
      *data = slice.begin() + slice.size() - backed_up_;
      *size = static_cast<int>(backed_up_);
      position_ += backed_up_;
      backed_up_ = 0;
      return true;
    }
    while (index_ < slices_->size() && (*slices_)[index_].size() == 0) ++index_;
    if (index_ == slices_->size()) return false;
    const grpc::Slice& slice = (*slices_)[index_++];
    *data = slice.begin();
    *size = static_cast<int>(slice.size());
    position_ += slice.size();
    return true;
  }
  void BackUp(int count) override {
    backed_up_ = static_cast<size_t>(count);
    position_ -= backed_up_;
  }
  bool Skip(int count) override {
    const void* data;
    int size;
    while (count > 0) {
      if (!Next(&data, &size)) return false;
      if (size > count) {
        BackUp(size - count);
        return true;
      }
      count -= size;
    }
    return true;
  }
  int64_t ByteCount() const override { return static_cast<int64_t>(position_); }

 private:
  const std::vector<grpc::Slice>* slices_;
  size_t index_ = 0;      // next slice to hand out
  size_t backed_up_ = 0;  // bytes at the end of slice index_-1 handed back by BackUp
  size_t position_ = 0;
};

// Reads `length` bytes of `in` as views of the buffers they lie in (no copy).
bool ReadPieces(CodedInputStream* in, size_t length, std::vector<absl::string_view>* pieces) {
  while (length > 0) {
    const void* data;
    int size;
    if (!in->GetDirectBufferPointer(&data, &size)) return false;
    const size_t take = std::min(length, static_cast<size_t>(size));
    pieces->emplace_back(static_cast<const char*>(data), take);
    if (!in->Skip(static_cast<int>(take))) return false;
    length -= take;
  }
  return true;
}

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("message does not parse: ", what));
}

}  // namespace

BorrowedBytes::~BorrowedBytes() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* outstanding) { return *outstanding == 0; }, &outstanding_));
}

grpc::Slice BorrowedBytes::Borrow(absl::string_view bytes) {
  {
    absl::MutexLock lock(&mu_);
    ++outstanding_;
  }
  // gRPC never writes through a slice it sends; the cast only fits its constructor.
  return grpc::Slice(const_cast<char*>(bytes.data()), bytes.size(), &BorrowedBytes::Release, this);
}

void BorrowedBytes::Release(void* self) {
  BorrowedBytes* borrowed = static_cast<BorrowedBytes*>(self);
  absl::MutexLock lock(&borrowed->mu_);
  --borrowed->outstanding_;
}

grpc::Slice TakeTensorBytes(Tensor tensor) {
  Tensor* owned = new Tensor(std::move(tensor));
  const absl::string_view bytes = owned->bytes();
  return grpc::Slice(
      const_cast<char*>(bytes.data()), bytes.size(),
      +[](void* tensor) { delete static_cast<Tensor*>(tensor); }, owned);
}

v1::Tensor TensorHead(const Tensor& tensor) {
  v1::Tensor head;
  head.set_datatype(DTypeName(tensor.dtype()));
  for (int64_t d : tensor.shape()) head.add_shape(d);
  return head;
}

grpc::ByteBuffer EncodeWithTensor(const google::protobuf::MessageLite& head, int tensor_field,
                                  const v1::Tensor& tensor_head, grpc::Slice bytes) {
  std::vector<grpc::Slice> slices;
  slices.push_back(std::move(bytes));
  return EncodeWithTensor(head, tensor_field, tensor_head, std::move(slices));
}

grpc::ByteBuffer EncodeWithTensor(const google::protobuf::MessageLite& head, int tensor_field,
                                  const v1::Tensor& tensor_head, std::vector<grpc::Slice> bytes) {
  size_t byte_count = 0;
  for (const grpc::Slice& slice : bytes) byte_count += slice.size();
  // Field order on the wire does not matter to a protobuf parser; the tensor goes last so
  // that its raw_data, last inside it, ends the message.
  const std::string tensor_fields = tensor_head.SerializeAsString();
  const size_t raw_data_prefix =
      WireFormatLite::TagSize(kRawDataField, WireFormatLite::TYPE_BYTES) +
      CodedOutputStream::VarintSize64(byte_count);
  const size_t tensor_size = tensor_fields.size() + raw_data_prefix + byte_count;
  std::string header = head.SerializeAsString();
  {
    google::protobuf::io::StringOutputStream stream(&header);
    CodedOutputStream out(&stream);
    AppendTag(tensor_field, &out);
    out.WriteVarint64(tensor_size);
    out.WriteRaw(tensor_fields.data(), static_cast<int>(tensor_fields.size()));
    AppendTag(kRawDataField, &out);
    out.WriteVarint64(byte_count);
  }  // `out` trims `header` to what was written when it goes
  std::vector<grpc::Slice> slices;
  slices.reserve(bytes.size() + 1);
  slices.emplace_back(header);
  for (grpc::Slice& slice : bytes) {
    if (slice.size() > 0) slices.push_back(std::move(slice));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeMessage(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

TensorBytes::TensorBytes(absl::string_view bytes) : size_(bytes.size()) {
  if (!bytes.empty()) {
    pieces_.push_back(bytes);
    piece_slice_.push_back(kBorrowPiece);
  }
}

void TensorBytes::AppendSlices(size_t offset, size_t length, BorrowedBytes* borrowed,
                               std::vector<grpc::Slice>* out, bool copy_views) const {
  const size_t end = offset + length;
  size_t at = 0;  // where pieces_[i] starts within the bytes
  for (size_t i = 0; i < pieces_.size() && at < end; at += pieces_[i].size(), ++i) {
    const absl::string_view piece = pieces_[i];
    if (at + piece.size() <= offset) continue;
    const size_t from = std::max(offset, at) - at;
    const size_t to = std::min(end, at + piece.size()) - at;
    if (piece_slice_[i] >= 0) {
      const grpc::Slice& slice = (*slices_)[piece_slice_[i]];
      const size_t base = piece.data() - reinterpret_cast<const char*>(slice.begin());
      out->push_back(slice.sub(base + from, base + to));
    } else if (piece_slice_[i] == kCopyPiece || copy_views) {
      out->emplace_back(piece.data() + from, to - from);
    } else {
      out->push_back(borrowed->Borrow(piece.substr(from, to - from)));
    }
  }
}

TensorBytes TensorBytes::Concat(const std::vector<TensorBytes>& parts) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  TensorBytes whole;
  for (const TensorBytes& part : parts) {
    part.AppendSlices(0, part.size(), /*borrowed=*/nullptr, slices.get(), /*copy_views=*/true);
  }
  // Pieces only once the vector is final: a small sub-slice holds its bytes inline, so they
  // move with it.
  for (size_t i = 0; i < slices->size(); ++i) {
    const grpc::Slice& slice = (*slices)[i];
    if (slice.size() == 0) continue;
    whole.pieces_.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
    whole.piece_slice_.push_back(static_cast<int>(i));
    whole.size_ += slice.size();
  }
  whole.slices_ = std::move(slices);
  return whole;
}

void TensorBytes::CopyTo(void* dst) const {
  char* at = static_cast<char*>(dst);
  for (absl::string_view piece : pieces_) {
    std::memcpy(at, piece.data(), piece.size());
    at += piece.size();
  }
}

absl::Status DecodeWithTensor(const grpc::ByteBuffer& wire, int tensor_field,
                              google::protobuf::MessageLite* head, TensorBytes* raw_data,
                              std::initializer_list<int> tensor_oneof) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (wire.Valid() && !wire.Dump(slices.get()).ok()) return Malformed("unreadable buffer");
  *raw_data = TensorBytes();
  std::vector<absl::string_view> pieces;
  size_t size = 0;
  // Every field but raw_data is copied (re-encoded as it came) into `header`, which protobuf
  // then parses: its rules for merging, oneofs, unknown fields and malformed input apply as
  // they would to the whole message.
  std::string header;
  {
    SliceInputStream stream(slices.get());
    CodedInputStream in(&stream);
    google::protobuf::io::StringOutputStream header_stream(&header);
    CodedOutputStream out(&header_stream);
    const uint32_t tensor_tag =
        WireFormatLite::MakeTag(tensor_field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
    const uint32_t raw_data_tag =
        WireFormatLite::MakeTag(kRawDataField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
    while (true) {
      const uint32_t tag = in.ReadTag();
      if (tag == 0) {
        if (!in.ConsumedEntireMessage()) return Malformed("invalid tag");
        break;
      }
      const int field = static_cast<int>(WireFormatLite::GetTagFieldNumber(tag));
      if (tag != tensor_tag) {
        if (std::find(tensor_oneof.begin(), tensor_oneof.end(), field) != tensor_oneof.end()) {
          pieces.clear();  // another member of the oneof replaces the tensor
          size = 0;
        }
        if (!WireFormatLite::SkipField(&in, tag, &out)) return Malformed("truncated field");
        continue;
      }
      int length;
      if (!in.ReadVarintSizeAsInt(&length)) return Malformed("bad length");
      const CodedInputStream::Limit limit = in.PushLimit(length);
      std::string tensor_fields;
      {
        google::protobuf::io::StringOutputStream tensor_stream(&tensor_fields);
        CodedOutputStream tensor_out(&tensor_stream);
        while (true) {
          const uint32_t inner = in.ReadTag();
          if (inner == 0) {
            if (!in.ConsumedEntireMessage()) return Malformed("invalid tag in tensor");
            break;
          }
          if (inner != raw_data_tag) {
            if (!WireFormatLite::SkipField(&in, inner, &tensor_out)) {
              return Malformed("truncated tensor field");
            }
            continue;
          }
          int raw_length;
          if (!in.ReadVarintSizeAsInt(&raw_length)) return Malformed("bad raw_data length");
          pieces.clear();  // the last raw_data wins
          if (!ReadPieces(&in, static_cast<size_t>(raw_length), &pieces)) {
            return Malformed("truncated raw_data");
          }
          size = static_cast<size_t>(raw_length);
        }
      }
      if (in.BytesUntilLimit() != 0) return Malformed("truncated tensor");
      in.PopLimit(limit);
      AppendTag(tensor_field, &out);
      out.WriteVarint64(tensor_fields.size());
      out.WriteRaw(tensor_fields.data(), static_cast<int>(tensor_fields.size()));
    }
  }  // `out` trims `header` to what was written when it goes
  if (!head->ParseFromString(header)) return Malformed(head->GetTypeName());
  // Which slice each piece lies in (pieces are in slice order), for AppendSlices.
  std::vector<int> piece_slice(pieces.size(), kCopyPiece);
  size_t next = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const char* data = pieces[i].data();
    for (size_t s = next; s < slices->size(); ++s) {
      const char* begin = reinterpret_cast<const char*>((*slices)[s].begin());
      if (data >= begin && data + pieces[i].size() <= begin + (*slices)[s].size()) {
        piece_slice[i] = static_cast<int>(s);
        next = s;
        break;
      }
    }
  }
  raw_data->slices_ = std::move(slices);
  raw_data->pieces_ = std::move(pieces);
  raw_data->piece_slice_ = std::move(piece_slice);
  raw_data->size_ = size;
  return absl::OkStatus();
}

absl::StatusOr<Tensor> TensorFromWire(absl::string_view field, const v1::Tensor& head,
                                      const TensorBytes& raw_data, Tensor* into,
                                      absl::string_view into_name) {
  ASSIGN_OR_RETURN(DType dtype, CheckTensorHead(field, head, raw_data.size()));
  std::vector<int64_t> shape(head.shape().begin(), head.shape().end());
  if (into == nullptr) {
    Tensor tensor = Tensor::Uninitialized(dtype, std::move(shape));
    raw_data.CopyTo(tensor.raw());
    return tensor;
  }
  RETURN_IF_ERROR(CheckTensorFits(into_name, *into, dtype, shape));
  raw_data.CopyTo(into->raw());
  return Tensor::View(dtype, std::move(shape), into->raw());
}

absl::Status CallUnary(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                       const char* method, const grpc::ByteBuffer& request,
                       grpc::ByteBuffer* answer) {
  // What a generated synchronous stub does (its completion queue is plucked on this thread),
  // with ByteBuffers for messages. GenericStub's UnaryCall would finish on a gRPC callback
  // thread and hand the result over: a thread switch per call, measurable on small steps.
  const grpc::internal::RpcMethod rpc(method, grpc::internal::RpcMethod::NORMAL_RPC);
  return FromGrpcStatus(grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(), rpc, context, request, answer));
}

}  // namespace moe
