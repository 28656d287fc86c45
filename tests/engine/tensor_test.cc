#include "engine/tensor.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(DTypeTest, NamesRoundTrip) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat64, DType::kInt32,
                  DType::kInt64}) {
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(ParseDType("FP8").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.5f)), 1.5f);
  // 1 + 2^-8 is exactly half-way between two bf16 values: ties to even (1.0).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3 * 2^-8 ties to the even neighbour above.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::infinity()))));
}

TEST(TensorTest, ByteCountIsChecked) {
  EXPECT_TRUE(CheckByteCount("x", DType::kFloat32, {2, 3}, 24).ok());
  absl::Status wrong = CheckByteCount("x", DType::kBFloat16, {2, 3}, 24);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.message().find("x:"), absl::string_view::npos);
  EXPECT_EQ(CheckByteCount("x", DType::kFloat32, {-1, 3}, 0).code(),
            absl::StatusCode::kInvalidArgument);
  // A shape whose byte count overflows 64 bits must not wrap around to a small number.
  EXPECT_EQ(CheckByteCount("x", DType::kFloat32, {1LL << 40, 1LL << 40}, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckByteCount("x", DType::kFloat32, {0, 7}, 0).ok());
}

TEST(TensorTest, ConvertAndSlice) {
  Tensor t = Tensor::FromFloats({3, 2}, {1, 2, 3, 4, 5, 6});
  Tensor b = t.ConvertTo(DType::kBFloat16);
  EXPECT_EQ(b.num_bytes(), 12u);
  EXPECT_EQ(b.GetFloat(5), 6.0f);
  Tensor rows = t.SliceRows(1, 3);
  EXPECT_EQ(rows.shape(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(rows.data<float>()[0], 3.0f);
  EXPECT_EQ(CheckShape("x", {2, 2}, {2, 3}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorTest, UninitializedHasTheShapeAndIsWritable) {
  Tensor t = Tensor::Uninitialized(DType::kBFloat16, {3, 5});
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(t.dtype(), DType::kBFloat16);
  EXPECT_EQ(t.num_bytes(), 30u);
  for (int i = 0; i < 15; ++i) t.data<uint16_t>()[i] = FloatToBf16(static_cast<float>(i));
  EXPECT_EQ(t.GetFloat(14), 14.0f);
  EXPECT_EQ(Tensor::Uninitialized(DType::kFloat32, {0, 4}).num_bytes(), 0u);
  // Zeros still zeroes (the storage's allocator only skips zeroing on resize).
  Tensor z = Tensor::Zeros(DType::kFloat32, {4});
  for (int i = 0; i < 4; ++i) EXPECT_EQ(z.data<float>()[i], 0.0f);
}

TEST(TensorTest, ViewReadsAndWritesTheCallersBytesAndCopiesStayViews) {
  std::vector<float> storage = {1, 2, 3, 4, 5, 6};
  Tensor v = Tensor::View(DType::kFloat32, {3, 2}, storage.data());
  EXPECT_TRUE(v.is_view());
  EXPECT_EQ(v.raw(), storage.data());
  EXPECT_EQ(v.num_bytes(), 24u);
  EXPECT_EQ(v.GetFloat(5), 6.0f);
  v.data<float>()[0] = 9.0f;
  EXPECT_EQ(storage[0], 9.0f);
  Tensor copy = v;  // a view of the same bytes, as with absl::string_view
  EXPECT_EQ(copy.raw(), storage.data());
  Tensor rows = v.SliceRows(1, 3);  // owns its bytes
  EXPECT_FALSE(rows.is_view());
  EXPECT_EQ(rows.data<float>()[0], 3.0f);
  Tensor bf16 = v.ConvertTo(DType::kBFloat16);
  EXPECT_FALSE(bf16.is_view());
  EXPECT_EQ(bf16.GetFloat(1), 2.0f);
  EXPECT_EQ(v.bytes(), absl::string_view(reinterpret_cast<const char*>(storage.data()), 24));
  Tensor empty = Tensor::View(DType::kFloat32, {0, 2}, nullptr);
  EXPECT_EQ(empty.num_bytes(), 0u);
}

// An empty tensor from no values: memcpy was called with null pointers (undefined behaviour,
// reported by UBSan in the EP tests' T = 0 slices).
TEST(TensorTest, FromFloatsOfAnEmptyShape) {
  const Tensor t = Tensor::FromFloats({0, 4}, {});
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(t.num_bytes(), 0u);
}

}  // namespace
}  // namespace moe
