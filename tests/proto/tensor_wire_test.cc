// proto/tensor_wire.h: the hand-written encoding is the protobuf encoding, borrows the tensor's
// bytes, and the hand split of a received message gives what protobuf's parser gives (fields,
// bytes, and the same verdict on malformed input).
#include "proto/tensor_wire.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tensor_convert.h"
#include "tests/proto/iota_tensor.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

// `bytes` as a received buffer of slices of `piece` bytes (the last may be shorter).
grpc::ByteBuffer Sliced(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    slices.emplace_back(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  if (slices.empty()) slices.emplace_back();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

v1::ForwardRequest SampleRequest(const Tensor& x) {
  v1::ForwardRequest request;
  request.set_layer("layer0");
  request.set_keep_for_backward(true);
  request.set_timing(true);
  TensorToProto(x, request.mutable_x());
  return request;
}

// Decodes `wire` both ways; expects the same verdict and, when it parses, the same message.
void ExpectSameAsProtobuf(const std::string& wire, size_t piece) {
  v1::ForwardRequest want;
  const bool want_ok = want.ParseFromString(wire);
  v1::ForwardRequest head;
  TensorBytes raw;
  const absl::Status got = DecodeWithTensor(Sliced(wire, piece), v1::ForwardRequest::kXFieldNumber,
                                            &head, &raw, {v1::ForwardRequest::kXShmFieldNumber});
  ASSERT_EQ(got.ok(), want_ok) << got << " (" << wire.size() << " bytes, pieces of " << piece
                               << ")";
  if (!got.ok()) {
    EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
    return;
  }
  EXPECT_TRUE(head.x().raw_data().empty());
  std::string bytes(raw.size(), '\0');
  raw.CopyTo(bytes.data());
  EXPECT_EQ(bytes, want.x().raw_data());
  if (want.has_x()) want.mutable_x()->clear_raw_data();
  EXPECT_EQ(head.SerializeAsString(), want.SerializeAsString());
}

TEST(TensorWireTest, EncodingParsesAsTheGeneratedOneAndBorrowsTheBytes) {
  for (int64_t rows : {0, 1, 3, 1000}) {
    const Tensor x = IotaTensor(DType::kFloat32, {rows, 2});
    v1::ForwardRequest head = SampleRequest(x);
    head.clear_x();
    BorrowedBytes borrowed;
    const grpc::ByteBuffer wire = EncodeWithTensor(head, v1::ForwardRequest::kXFieldNumber,
                                                   TensorHead(x), borrowed.Borrow(x.bytes()));
    v1::ForwardRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(Flatten(wire)));
    EXPECT_TRUE(parsed.SerializeAsString() == SampleRequest(x).SerializeAsString()) << rows;
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(wire.Dump(&slices).ok());
    if (rows > 0) {
      ASSERT_EQ(slices.size(), 2u);
      EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), x.bytes().data());
    }
  }
}

TEST(TensorWireTest, TakenTensorBytesLiveAsLongAsTheBuffer) {
  Tensor x = IotaTensor(DType::kBFloat16, {64, 8});
  const std::string want(x.bytes());
  v1::ForwardResponse head;
  head.set_aux_loss(0.5);
  grpc::ByteBuffer wire = EncodeWithTensor(head, v1::ForwardResponse::kOutFieldNumber,
                                           TensorHead(x), TakeTensorBytes(std::move(x)));
  v1::ForwardResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(wire)));
  EXPECT_EQ(parsed.out().raw_data(), want);
  EXPECT_EQ(parsed.aux_loss(), 0.5);
}

TEST(TensorWireTest, DecodedTensorIsBitIdenticalAcrossSliceBoundaries) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kInt64}) {
    const Tensor x = IotaTensor(dtype, {37, 5});
    const std::string wire = SampleRequest(x).SerializeAsString();
    for (size_t piece : {size_t{1}, size_t{3}, size_t{7}, size_t{64}, wire.size()}) {
      v1::ForwardRequest head;
      TensorBytes raw;
      ASSERT_TRUE(
          DecodeWithTensor(Sliced(wire, piece), v1::ForwardRequest::kXFieldNumber, &head, &raw)
              .ok());
      EXPECT_EQ(head.layer(), "layer0");
      EXPECT_TRUE(head.keep_for_backward());
      absl::StatusOr<Tensor> got = TensorFromWire("x", head.x(), raw);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->dtype(), dtype);
      EXPECT_EQ(got->shape(), x.shape());
      EXPECT_EQ(got->bytes(), x.bytes()) << "pieces of " << piece;
    }
  }
}

// moed's forward batcher: several received tensors' bytes joined into one, in order, still
// valid after the parts and their buffers are gone; a view of caller-owned bytes is copied.
TEST(TensorWireTest, ConcatJoinsPartsAndOutlivesThem) {
  const Tensor a = IotaTensor(DType::kFloat32, {5, 3});
  const Tensor b = IotaTensor(DType::kFloat32, {7, 3});
  std::string owned = "caller-owned";
  TensorBytes whole;
  {
    std::vector<TensorBytes> parts(3);
    grpc::ByteBuffer wire_a = Sliced(SampleRequest(a).SerializeAsString(), 7);
    v1::ForwardRequest head;
    ASSERT_TRUE(DecodeWithTensor(wire_a, v1::ForwardRequest::kXFieldNumber, &head, &parts[0]).ok());
    parts[1] = TensorBytes(owned);
    grpc::ByteBuffer wire_b = Sliced(SampleRequest(b).SerializeAsString(), 5);
    ASSERT_TRUE(DecodeWithTensor(wire_b, v1::ForwardRequest::kXFieldNumber, &head, &parts[2]).ok());
    whole = TensorBytes::Concat(parts);
  }
  const std::string want = std::string(a.bytes()) + "caller-owned" + std::string(b.bytes());
  owned.assign(owned.size(), 'X');  // the view was copied, not borrowed
  ASSERT_EQ(whole.size(), want.size());
  std::string got(whole.size(), '\0');
  whole.CopyTo(got.data());
  EXPECT_EQ(got, want);
  std::vector<grpc::Slice> rows;
  whole.AppendSlices(10, 40, /*borrowed=*/nullptr, &rows);
  std::string sliced;
  for (const grpc::Slice& s : rows) sliced.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(sliced, want.substr(10, 40));
}

// moed's relay: rows of a received tensor go on to another message as references to the
// received slices (same memory, no copy), and several answers' bytes join into one message.
TEST(TensorWireTest, ReceivedBytesAreForwardedAsSubSlicesWithoutCopy) {
  const Tensor x = IotaTensor(DType::kFloat32, {29, 3});
  const std::string wire = SampleRequest(x).SerializeAsString();
  for (size_t piece : {size_t{5}, size_t{64}, size_t{100}, wire.size()}) {
    const grpc::ByteBuffer received = Sliced(wire, piece);
    std::vector<grpc::Slice> received_slices;
    ASSERT_TRUE(received.Dump(&received_slices).ok());
    v1::ForwardRequest head;
    TensorBytes raw;
    ASSERT_TRUE(
        DecodeWithTensor(received, v1::ForwardRequest::kXFieldNumber, &head, &raw).ok());
    const size_t row = 3 * sizeof(float);
    // Rows [0, 10), [10, 29) and an empty range, re-encoded as two messages' tensors.
    for (auto [begin, end] : {std::pair<size_t, size_t>{0, 10}, {10, 29}, {7, 7}}) {
      std::vector<grpc::Slice> rows;
      raw.AppendSlices(begin * row, (end - begin) * row, /*borrowed=*/nullptr, &rows);
      size_t total = 0;
      for (const grpc::Slice& slice : rows) {
        total += slice.size();
        if (slice.size() <= 32) continue;  // small slices are inlined copies
        const auto* at = slice.begin();
        bool inside = false;
        for (const grpc::Slice& r : received_slices) {
          inside |= at >= r.begin() && at + slice.size() <= r.end();
        }
        EXPECT_TRUE(inside) << "a copy, not a reference to the received bytes";
      }
      EXPECT_EQ(total, (end - begin) * row);
      v1::ForwardRequest out_head;
      out_head.set_layer("next");
      v1::Tensor tensor_head;
      tensor_head.set_datatype("FP32");
      tensor_head.add_shape(static_cast<int64_t>(end - begin));
      tensor_head.add_shape(3);
      const grpc::ByteBuffer forwarded = EncodeWithTensor(
          out_head, v1::ForwardRequest::kXFieldNumber, tensor_head, std::move(rows));
      v1::ForwardRequest parsed;
      ASSERT_TRUE(parsed.ParseFromString(Flatten(forwarded)));
      EXPECT_EQ(parsed.layer(), "next");
      EXPECT_EQ(parsed.x().raw_data(), x.bytes().substr(begin * row, (end - begin) * row))
          << "pieces of " << piece << ", rows " << begin << ".." << end;
    }
  }
  // A view of caller-owned bytes is lent through BorrowedBytes.
  const std::string owned(x.bytes());
  BorrowedBytes borrowed;
  std::vector<grpc::Slice> lent;
  TensorBytes(owned).AppendSlices(12, 24, &borrowed, &lent);
  ASSERT_EQ(lent.size(), 1u);
  EXPECT_EQ(reinterpret_cast<const char*>(lent[0].begin()), owned.data() + 12);
  EXPECT_EQ(lent[0].size(), 24u);
}

TEST(TensorWireTest, ProtobufRulesHoldForRepeatedFieldsAndTheOneof) {
  const Tensor a = IotaTensor(DType::kFloat32, {2, 2});
  const Tensor b = IotaTensor(DType::kFloat32, {3, 2});
  v1::ForwardRequest first = SampleRequest(a);
  v1::ForwardRequest second;
  second.mutable_x()->set_raw_data(std::string(b.bytes()));  // last raw_data wins
  v1::ForwardRequest shape_only;
  shape_only.mutable_x()->add_shape(9);  // merged: shapes append
  v1::ForwardRequest shm;
  shm.mutable_x_shm()->set_region("r");  // clears x (a oneof)
  const std::string f = first.SerializeAsString(), s = second.SerializeAsString(),
                    o = shape_only.SerializeAsString(), m = shm.SerializeAsString();
  for (const std::string& wire : {f + s, s + f, f + o, f + m, m + f, f + m + s, f + m + o + s}) {
    for (size_t piece : {size_t{2}, wire.size()}) ExpectSameAsProtobuf(wire, piece);
  }
}

TEST(TensorWireTest, MalformedInputFailsExactlyWhenProtobufFails) {
  const std::string wire = SampleRequest(IotaTensor(DType::kFloat32, {4, 3})).SerializeAsString();
  for (size_t cut = 0; cut <= wire.size(); ++cut) {  // every truncation
    ExpectSameAsProtobuf(wire.substr(0, cut), 5);
  }
  for (size_t at = 0; at < wire.size(); ++at) {  // every byte replaced by a few values
    for (char c : {'\x00', '\x07', '\x0c', '\x1a', '\x7f', '\x80', '\xff'}) {
      std::string bad = wire;
      bad[at] = c;
      ExpectSameAsProtobuf(bad, 3);
    }
  }
}

TEST(TensorWireTest, TensorFromWireChecksLikeTensorFromProto) {
  v1::Tensor head;
  head.set_datatype("FP32");
  head.add_shape(2);
  head.add_shape(3);
  const std::string short_bytes(20, 'a');
  const absl::Status wire = TensorFromWire("x", head, TensorBytes(short_bytes)).status();
  head.set_raw_data(short_bytes);
  const absl::Status proto = TensorFromProto("x", head).status();
  EXPECT_EQ(wire.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(wire, proto);
  head.set_datatype("FP33");
  EXPECT_THAT(std::string(TensorFromWire("x", head, TensorBytes(short_bytes)).status().message()),
              HasSubstr("x.datatype"));
}

}  // namespace
}  // namespace moe
