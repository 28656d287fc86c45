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

}  // namespace
}  // namespace moe
