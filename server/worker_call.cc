#include "server/worker_call.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "proto/status_convert.h"

namespace moe {
namespace {

using google::protobuf::internal::WireFormatLite;

constexpr int kRawDataField = 3;  // moe.v1.Tensor.raw_data

void AppendTag(int field, google::protobuf::io::CodedOutputStream* out) {
  out->WriteTag(WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
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

grpc::ByteBuffer EncodeWithTensor(const google::protobuf::MessageLite& head, int tensor_field,
                                  const v1::Tensor& tensor_head, grpc::Slice bytes) {
  // Field order on the wire does not matter to a protobuf parser; the tensor goes last so
  // that its raw_data, last inside it, ends the message.
  const std::string tensor_fields = tensor_head.SerializeAsString();
  const size_t raw_data_prefix =
      WireFormatLite::TagSize(kRawDataField, WireFormatLite::TYPE_BYTES) +
      google::protobuf::io::CodedOutputStream::VarintSize64(bytes.size());
  const size_t tensor_size = tensor_fields.size() + raw_data_prefix + bytes.size();
  std::string header = head.SerializeAsString();
  {
    google::protobuf::io::StringOutputStream stream(&header);
    google::protobuf::io::CodedOutputStream out(&stream);
    AppendTag(tensor_field, &out);
    out.WriteVarint64(tensor_size);
    out.WriteRaw(tensor_fields.data(), static_cast<int>(tensor_fields.size()));
    AppendTag(kRawDataField, &out);
    out.WriteVarint64(bytes.size());
  }  // `out` trims `header` to what was written when it goes
  grpc::Slice slices[2] = {grpc::Slice(header), std::move(bytes)};
  return grpc::ByteBuffer(slices, slices[1].size() == 0 ? 1 : 2);
}

grpc::ByteBuffer EncodeMessage(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status CallWorker(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                        const char* method, const grpc::ByteBuffer& request,
                        google::protobuf::MessageLite* response) {
  grpc::GenericStub stub(channel);
  grpc::ByteBuffer answer;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(context, method, grpc::StubOptions(), &request, &answer, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  if (!status.ok()) return FromGrpcStatus(status);
  grpc::ProtoBufferReader reader(&answer);
  if (!response->ParseFromZeroCopyStream(&reader)) {
    return absl::InternalError(absl::StrCat("could not parse the answer of ", method));
  }
  return absl::OkStatus();
}

}  // namespace moe
