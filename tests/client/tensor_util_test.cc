// The bf16 / random / error helpers of client/tensor_util.h.
#include "client/tensor_util.h"

#include <cmath>

#include "gtest/gtest.h"

namespace moe {
namespace client {
namespace {

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
