// .npy reading and writing (client/npy.h): round trips, files written by NumPy itself, and
// the errors for files the reader does not support.
#include "client/npy.h"

#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace moe {
namespace client {
namespace {

// np.save(f, np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5), NumPy 1.24.
const char kNumpyF32[] =
    "\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"
    "                                                          \n"
    "\x00\x00\x00\x00\x00\x00\x00?\x00\x00\x80?\x00\x00\xc0?\x00\x00\x00@\x00\x00 @";
// np.save(f, np.array([1, -2, 3], dtype=np.int64)).
const char kNumpyI64[] =
    "\x93NUMPY\x01\x00v\x00{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }"
    "                                                            \n"
    "\x01\x00\x00\x00\x00\x00\x00\x00\xfe\xff\xff\xff\xff\xff\xff\xff"
    "\x03\x00\x00\x00\x00\x00\x00\x00";

TEST(NpyTest, ReadsFloat32WrittenByNumpy) {
  auto t = ParseNpy(std::string(kNumpyF32, sizeof(kNumpyF32) - 1));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), DType::kFloat32);
  EXPECT_EQ(t->shape(), (std::vector<int64_t>{2, 3}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(t->data<float>()[i], 0.5f * i);
}

TEST(NpyTest, ReadsInt64Vector) {
  auto t = ParseNpy(std::string(kNumpyI64, sizeof(kNumpyI64) - 1));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), DType::kInt64);
  EXPECT_EQ(t->shape(), (std::vector<int64_t>{3}));
  EXPECT_EQ(t->data<int64_t>()[1], -2);
}

TEST(NpyTest, WritesWhatNumpyWrites) {
  Tensor t = Tensor::FromFloats({2, 3}, {0, 0.5, 1, 1.5, 2, 2.5});
  EXPECT_EQ(SerializeNpy(t), std::string(kNumpyF32, sizeof(kNumpyF32) - 1));
}

TEST(NpyTest, HeaderIsAlignedTo64) {
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{}, {0}, {7}, {123456789, 0}, {1, 2, 3, 4, 5}}) {
    const std::string bytes = SerializeNpy(Tensor::Zeros(DType::kFloat64, shape));
    const size_t header_len = static_cast<uint8_t>(bytes[8]) | static_cast<uint8_t>(bytes[9]) << 8;
    EXPECT_EQ((10 + header_len) % 64, 0u);
    EXPECT_EQ(bytes[10 + header_len - 1], '\n');
    auto back = ParseNpy(bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->shape(), shape);
    EXPECT_EQ(back->dtype(), DType::kFloat64);
  }
}

TEST(NpyTest, RoundTripsEveryDTypeThroughAFile) {
  const std::string path = ::testing::TempDir() + "/npy_test.npy";
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kInt32, DType::kInt64}) {
    Tensor t = Tensor::Zeros(dtype, {3, 5});
    for (size_t i = 0; i < t.num_bytes(); ++i) t.data<uint8_t>()[i] = static_cast<uint8_t>(i * 7);
    ASSERT_TRUE(WriteNpy(path, t).ok());
    auto back = ReadNpy(path);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype(), dtype);
    EXPECT_EQ(back->shape(), t.shape());
    EXPECT_EQ(back->bytes(), t.bytes());
  }
  std::remove(path.c_str());
}

TEST(NpyTest, Bf16IsStoredAsExactFloat32) {
  Tensor t =
      Tensor::FromFloats({4}, {1.0f, -0.0078125f, 3.140625f, 1e30f}).ConvertTo(DType::kBFloat16);
  auto back = ParseNpy(SerializeNpy(t));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype(), DType::kFloat32);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(back->data<float>()[i], t.GetFloat(i));
  EXPECT_EQ(back->ConvertTo(DType::kBFloat16).bytes(), t.bytes());
}

TEST(NpyTest, RejectsBadFiles) {
  const std::string good(kNumpyF32, sizeof(kNumpyF32) - 1);
  EXPECT_EQ(ParseNpy("hello").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseNpy(good.substr(0, good.size() - 1)).status().code(),
            absl::StatusCode::kInvalidArgument);  // truncated data
  EXPECT_EQ(ParseNpy(good.substr(0, 40)).status().code(),
            absl::StatusCode::kInvalidArgument);  // truncated header
  std::string fortran = good;
  fortran.replace(fortran.find("False"), 5, "True ");
  EXPECT_EQ(ParseNpy(fortran).status().code(), absl::StatusCode::kInvalidArgument);
  std::string big_endian = good;
  big_endian[big_endian.find("<f4")] = '>';
  auto s = ParseNpy(big_endian).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(">f4"), std::string::npos) << s;
  EXPECT_EQ(ReadNpy("/nonexistent/x.npy").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace client
}  // namespace moe
