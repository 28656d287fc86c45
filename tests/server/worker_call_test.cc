// server/worker_call.h: the borrowed-bytes encoding of a worker request is the protobuf
// encoding of the same request, and it copies no tensor byte.
#include "server/worker_call.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/worker.pb.h"

namespace moe {
namespace {

internal::WorkerForwardRequest Parse(const grpc::ByteBuffer& buffer) {
  grpc::ByteBuffer copy(buffer);
  grpc::ProtoBufferReader reader(&copy);
  internal::WorkerForwardRequest parsed;
  EXPECT_TRUE(parsed.ParseFromZeroCopyStream(&reader));
  return parsed;
}

TEST(WorkerCall, EncodingParsesAsTheGeneratedOne) {
  for (size_t rows : {0, 1, 3, 1000}) {
    std::string data(rows * 8, '\0');
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
    internal::WorkerForwardRequest head;
    head.set_generation(3);
    head.set_layer_id(7);
    head.set_step_id(rows);
    head.set_timing(true);
    v1::Tensor x_head;
    x_head.set_datatype("FP32");
    x_head.add_shape(rows);
    x_head.add_shape(2);

    internal::WorkerForwardRequest want = head;
    *want.mutable_x() = x_head;
    want.mutable_x()->set_raw_data(data);

    BorrowedBytes borrowed;
    const grpc::ByteBuffer wire = EncodeWithTensor(
        head, internal::WorkerForwardRequest::kXFieldNumber, x_head, borrowed.Borrow(data));
    // Same message (the fields' order on the wire differs: the tensor goes last).
    const internal::WorkerForwardRequest parsed = Parse(wire);
    EXPECT_TRUE(parsed.SerializeAsString() == want.SerializeAsString()) << rows << " rows";
    EXPECT_EQ(parsed.x().raw_data().size(), data.size());
  }
}

TEST(WorkerCall, TensorBytesAreBorrowedNotCopied) {
  const std::string data(1 << 20, 'x');
  BorrowedBytes borrowed;
  internal::WorkerForwardRequest head;
  v1::Tensor x_head;
  x_head.set_datatype("FP32");
  x_head.add_shape(1 << 18);
  const grpc::ByteBuffer wire = EncodeWithTensor(
      head, internal::WorkerForwardRequest::kXFieldNumber, x_head, borrowed.Borrow(data));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(wire.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), data.data());
  EXPECT_EQ(slices[1].size(), data.size());
}

// A step whose share for one rank would pass one gRPC message is refused before any call,
// naming the field, the rank and the bytes; shares at the limit pass, and the default limit
// is gRPC's and protobuf's int lengths less room for the other fields.
TEST(WorkerCall, SharesLargerThanOneMessageAreRefusedUpFront) {
  EXPECT_TRUE(CheckWorkerMessageSizes("x", {0, 4, 8}, 100, 400).ok());
  const absl::Status over = CheckWorkerMessageSizes("x", {0, 4, 9}, 100, 400);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("x: worker 1's 5 rows are 500 bytes"), std::string::npos)
      << over.message();
  EXPECT_NE(over.message().find("--shm_relay_max_bytes"), std::string::npos);
  EXPECT_TRUE(CheckWorkerMessageSizes("out", {0, 0}, 1 << 20).ok());  // no rows
  // 2 GiB of one rank: over the default; the same split over 2 ranks is not.
  const int64_t rows = int64_t{1} << 19;  // of 4 KiB: 2 GiB
  EXPECT_EQ(CheckWorkerMessageSizes("d_x", {0, rows}, 4096).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(CheckWorkerMessageSizes("d_x", {0, rows / 2, rows}, 4096).ok());
  EXPECT_LT(kMaxWorkerMessageTensorBytes, int64_t{INT_MAX});
  // A byte count that overflows is refused too, not wrapped.
  EXPECT_FALSE(CheckWorkerMessageSizes("x", {0, int64_t{1} << 40}, size_t{1} << 30).ok());
}

}  // namespace
}  // namespace moe
