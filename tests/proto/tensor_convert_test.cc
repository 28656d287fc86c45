// moe.v1.Tensor <-> moe::Tensor (proto/tensor_convert.h).
#include "proto/tensor_convert.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/proto/iota_tensor.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

v1::Tensor ToProto(const Tensor& t) {
  v1::Tensor proto;
  TensorToProto(t, &proto);
  return proto;
}

TEST(TensorConvertTest, RoundTripsEveryDatatype) {
  for (DType dtype :
       {DType::kFloat32, DType::kBFloat16, DType::kFloat64, DType::kInt32, DType::kInt64}) {
    const Tensor t = IotaTensor(dtype, {3, 4});
    const v1::Tensor proto = ToProto(t);
    EXPECT_EQ(proto.datatype(), DTypeName(dtype));
    EXPECT_EQ(proto.raw_data().size(), t.num_bytes());
    absl::StatusOr<Tensor> back = TensorFromProto("x", proto);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype(), dtype);
    EXPECT_EQ(back->shape(), t.shape());
    EXPECT_EQ(back->bytes(), t.bytes());
    EXPECT_EQ(*CheckTensorProto("x", proto), dtype);
  }
}

TEST(TensorConvertTest, WireNamesAreKServeNames) {
  EXPECT_EQ(ToProto(Tensor::Zeros(DType::kBFloat16, {1})).datatype(), "BF16");
  EXPECT_EQ(ToProto(Tensor::Zeros(DType::kFloat32, {1})).datatype(), "FP32");
  EXPECT_EQ(ToProto(Tensor::Zeros(DType::kInt64, {1})).datatype(), "INT64");
}

TEST(TensorConvertTest, ToProtoReplacesAnEarlierShape) {
  v1::Tensor proto = ToProto(IotaTensor(DType::kFloat32, {2, 2, 2}));
  TensorToProto(IotaTensor(DType::kFloat32, {3}), &proto);
  EXPECT_THAT(proto.shape(), ::testing::ElementsAre(3));
}

TEST(TensorConvertTest, ErrorsAreInvalidArgumentNamingTheField) {
  v1::Tensor proto;
  proto.add_shape(2);
  absl::Status s = TensorFromProto("x", proto).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("x.datatype: required"));

  proto.set_datatype("FP16");
  s = TensorFromProto("x", proto).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("x.datatype"));
  EXPECT_THAT(s.message(), HasSubstr("FP16"));

  proto.set_datatype("FP32");
  proto.set_raw_data(std::string(7, '\0'));  // 2 floats are 8 bytes
  s = TensorFromProto("d_out", proto).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("d_out"));
  EXPECT_EQ(CheckTensorProto("d_out", proto).status().code(), absl::StatusCode::kInvalidArgument);

  proto = ToProto(IotaTensor(DType::kFloat32, {2, 2}));
  proto.set_shape(0, -2);
  proto.set_shape(1, -2);  // the product is positive: the sign of each dimension counts
  EXPECT_EQ(TensorFromProto("x", proto).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorConvertTest, DatatypeNames) {
  EXPECT_EQ(*DTypeFromProto("t.datatype", "BF16"), DType::kBFloat16);
  EXPECT_THAT(DTypeFromProto("t.datatype", "").status().message(), HasSubstr("required"));
  EXPECT_THAT(DTypeFromProto("t.datatype", "bf16").status().message(),
              HasSubstr("unknown datatype \"bf16\""));
}

}  // namespace
}  // namespace moe
