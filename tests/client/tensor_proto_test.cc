// Tensor <-> moe.v1 conversions (client/tensor_proto.h) and the bf16 / error helpers of
// client/tensor_util.h.
#include "client/tensor_proto.h"

#include <cmath>

#include "client/tensor_util.h"
#include "gtest/gtest.h"

namespace moe {
namespace client {
namespace {

Tensor Iota(DType dtype, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(dtype, shape);
  for (size_t i = 0; i < t.num_bytes(); ++i)
    t.data<uint8_t>()[i] = static_cast<uint8_t>(i * 13 + 1);
  return t;
}

TEST(TensorProtoTest, RoundTripsEveryDType) {
  for (DType dtype :
       {DType::kFloat32, DType::kBFloat16, DType::kFloat64, DType::kInt32, DType::kInt64}) {
    const Tensor t = Iota(dtype, {3, 4});
    const v1::Tensor wire = TensorToProto(t);
    EXPECT_EQ(wire.datatype(), DTypeName(dtype));
    EXPECT_EQ(wire.raw_data().size(), t.num_bytes());
    auto back = TensorFromProto(wire);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype(), dtype);
    EXPECT_EQ(back->shape(), t.shape());
    EXPECT_EQ(back->bytes(), t.bytes());
  }
}

TEST(TensorProtoTest, WireNamesAreKServeNames) {
  EXPECT_EQ(TensorToProto(Tensor::Zeros(DType::kBFloat16, {1})).datatype(), "BF16");
  EXPECT_EQ(TensorToProto(Tensor::Zeros(DType::kFloat32, {1})).datatype(), "FP32");
  EXPECT_EQ(TensorToProto(Tensor::Zeros(DType::kInt64, {1})).datatype(), "INT64");
}

TEST(TensorProtoTest, RejectsMalformedTensors) {
  v1::Tensor wire = TensorToProto(Iota(DType::kFloat32, {2, 2}));
  wire.set_datatype("FP16");
  auto s = TensorFromProto(wire, "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("x.datatype"), std::string::npos) << s;

  wire = TensorToProto(Iota(DType::kFloat32, {2, 2}));
  wire.mutable_raw_data()->pop_back();
  EXPECT_EQ(TensorFromProto(wire, "x").status().code(), absl::StatusCode::kInvalidArgument);

  wire = TensorToProto(Iota(DType::kFloat32, {2, 2}));
  wire.set_shape(0, -2);
  wire.set_shape(1, -2);
  EXPECT_EQ(TensorFromProto(wire, "x").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChunkTest, SplitsAndReassembles) {
  const Tensor a = Iota(DType::kFloat32, {5, 7});  // 140 bytes
  const Tensor b = Iota(DType::kFloat32, {0, 3});  // empty
  const Tensor c = Iota(DType::kInt64, {2});
  auto chunks_a = ChunkTensor("a", a, 48);  // 12 elements per chunk -> 12, 12, 11
  ASSERT_EQ(chunks_a.size(), 3u);
  EXPECT_EQ(chunks_a[1].element_offset(), 12);
  EXPECT_EQ(chunks_a[2].raw_data().size(), 44u);
  auto chunks_b = ChunkTensor("b", b, 48);
  ASSERT_EQ(chunks_b.size(), 1u);
  EXPECT_TRUE(chunks_b[0].raw_data().empty());
  auto chunks_c = ChunkTensor("c", c, 3);  // smaller than one element: one element per chunk
  ASSERT_EQ(chunks_c.size(), 2u);

  ChunkAssembler assembler;
  for (const auto* list : {&chunks_a, &chunks_b, &chunks_c}) {
    for (const auto& chunk : *list) ASSERT_TRUE(assembler.Add(chunk).ok());
  }
  auto tensors = assembler.Finish();
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 3u);
  EXPECT_EQ((*tensors)[0].name, "a");
  EXPECT_EQ((*tensors)[0].tensor.bytes(), a.bytes());
  EXPECT_EQ((*tensors)[1].tensor.shape(), b.shape());
  EXPECT_EQ((*tensors)[2].tensor.bytes(), c.bytes());
}

TEST(ChunkTest, RejectsBrokenStreams) {
  const Tensor a = Iota(DType::kFloat32, {4, 4});
  auto chunks = ChunkTensor("a", a, 16);  // 4 chunks
  {
    ChunkAssembler assembler;  // gap
    ASSERT_TRUE(assembler.Add(chunks[0]).ok());
    EXPECT_EQ(assembler.Add(chunks[2]).code(), absl::StatusCode::kInvalidArgument);
  }
  {
    ChunkAssembler assembler;  // incomplete at the end
    ASSERT_TRUE(assembler.Add(chunks[0]).ok());
    EXPECT_EQ(assembler.Finish().status().code(), absl::StatusCode::kInvalidArgument);
  }
  {
    ChunkAssembler assembler;  // interrupted by another tensor
    ASSERT_TRUE(assembler.Add(chunks[0]).ok());
    EXPECT_EQ(assembler.Add(ChunkTensor("b", a, 1 << 20)[0]).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    ChunkAssembler assembler;  // shape changes mid-tensor
    ASSERT_TRUE(assembler.Add(chunks[0]).ok());
    auto bad = chunks[1];
    bad.set_shape(0, 8);
    EXPECT_EQ(assembler.Add(bad).code(), absl::StatusCode::kInvalidArgument);
  }
  {
    ChunkAssembler assembler;  // the same tensor twice
    for (const auto& chunk : chunks) ASSERT_TRUE(assembler.Add(chunk).ok());
    EXPECT_EQ(assembler.Add(chunks[0]).code(), absl::StatusCode::kInvalidArgument);
  }
  {
    ChunkAssembler assembler;  // overrun and partial elements
    auto big = chunks[3];
    big.set_element_offset(0);
    big.mutable_raw_data()->append(std::string(64, 'x'));
    EXPECT_EQ(assembler.Add(big).code(), absl::StatusCode::kInvalidArgument);
    ChunkAssembler other;
    auto ragged = chunks[0];
    ragged.mutable_raw_data()->pop_back();
    EXPECT_EQ(other.Add(ragged).code(), absl::StatusCode::kInvalidArgument);
  }
  {
    // A shape whose element count overflows int64 (here (2^62 + 1) * 4 wraps to 4) must not
    // yield a 4-element tensor claiming that shape, nor try to allocate it.
    ChunkAssembler assembler;
    v1::TensorChunk huge;
    huge.set_name("huge");
    huge.set_datatype("FP32");
    huge.add_shape((int64_t{1} << 62) + 1);
    huge.add_shape(4);
    huge.set_raw_data(std::string(16, '\0'));
    EXPECT_EQ(assembler.Add(huge).code(), absl::StatusCode::kInvalidArgument);
    ChunkAssembler wrapped_to_zero;
    huge.set_shape(0, int64_t{1} << 62);
    huge.clear_raw_data();
    EXPECT_EQ(wrapped_to_zero.Add(huge).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(TensorUtilTest, Bf16RoundsToNearestEven) {
  const Tensor x = Tensor::FromFloats({3}, {1.0f, 1.00390625f, 1.01171875f});
  const Tensor b = ToBf16(x);
  EXPECT_EQ(b.dtype(), DType::kBFloat16);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even -> 1.
  EXPECT_EQ(b.GetFloat(1), 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even -> 1 + 2^-6.
  EXPECT_EQ(b.GetFloat(2), 1.015625f);
  EXPECT_EQ(ToFp32(b).dtype(), DType::kFloat32);
}

TEST(TensorUtilTest, RandomNormalIsReproducibleAndNormal) {
  const Tensor a = RandomNormal(DType::kFloat32, {100, 100}, 42);
  const Tensor b = RandomNormal(DType::kFloat32, {100, 100}, 42);
  const Tensor c = RandomNormal(DType::kFloat32, {100, 100}, 43);
  EXPECT_EQ(a.bytes(), b.bytes());
  EXPECT_NE(a.bytes(), c.bytes());
  double sum = 0, sum_sq = 0;
  for (float v : ToFloatVector(a)) {
    sum += v;
    sum_sq += v * v;
  }
  EXPECT_NEAR(sum / 1e4, 0.0, 0.05);
  EXPECT_NEAR(sum_sq / 1e4, 1.0, 0.05);
  EXPECT_EQ(RandomNormal(DType::kBFloat16, {3}, 1).dtype(), DType::kBFloat16);
}

TEST(TensorUtilTest, MaxRelErrorIsRelativeToTheReferenceScale) {
  const Tensor ref = Tensor::FromFloats({3}, {1.0f, -4.0f, 0.0f});
  const Tensor got = Tensor::FromFloats({3}, {1.0f, -4.0f, 0.004f});
  EXPECT_NEAR(*MaxRelError(got, ref), 0.001, 1e-9);
  EXPECT_EQ(*MaxRelError(ref, ref), 0.0);
  const Tensor nan = Tensor::FromFloats({3}, {1.0f, NAN, 0.0f});
  EXPECT_TRUE(std::isinf(*MaxRelError(nan, ref)));
  EXPECT_EQ(MaxRelError(ref, Tensor::FromFloats({1, 3}, {1, 2, 3})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NEAR(ScalarRelError(1.001, 1.0), 0.001, 1e-12);
  EXPECT_EQ(ScalarRelError(0.0, 0.0), 0.0);
}

}  // namespace
}  // namespace client
}  // namespace moe
