// Tensor files of checkpoints: CRC-32C values, round trips, and that every corrupted byte and
// every truncation is rejected with DATA_LOSS.
#include "engine/checkpoint_file.h"

#include <dirent.h>
#include <stdlib.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string templ = std::string(base != nullptr ? base : "/tmp") + "/ckptfile.XXXXXX";
  char* made = ::mkdtemp(templ.data());
  EXPECT_NE(made, nullptr);
  return templ;
}

void WriteRaw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* entry = ::readdir(d)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

// Bit-at-a-time CRC-32C, the definition itself.
uint32_t SlowCrc32c(const std::string& data) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int b = 0; b < 8; ++b) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

TEST(Crc32c, KnownValues) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(Crc32c, MatchesDefinitionAndExtends) {
  std::mt19937 rng(7);
  for (int len = 0; len < 200; ++len) {
    std::string data(len, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    ASSERT_EQ(Crc32c(data), SlowCrc32c(data)) << "length " << len;
    ASSERT_EQ(Crc32cPortable(data.data(), data.size()), SlowCrc32c(data)) << "length " << len;
    const size_t cut = len / 3;
    EXPECT_EQ(Crc32c(data.substr(cut), Crc32c(data.substr(0, cut))), Crc32c(data));
  }
}

std::vector<NamedTensor> SampleTensors() {
  Tensor a = Tensor::FromFloats({2, 3}, {1, -2, 3.5f, 4, 5, 6});
  Tensor b = Tensor::FromFloats({3}, {0.25f, 7, -1}).ConvertTo(DType::kBFloat16);
  Tensor c = Tensor::Zeros(DType::kInt64, {2});
  c.data<int64_t>()[1] = -42;
  Tensor empty = Tensor::Zeros(DType::kFloat32, {0, 4});
  return {{"wi", a}, {"wi.m", b}, {"counts", c}, {"none", empty}};
}

TEST(TensorFile, RoundTripIsExact) {
  const std::string path = TempDir() + "/t.bin";
  std::vector<NamedTensor> in = SampleTensors();
  ASSERT_TRUE(WriteTensorFile(path, in).ok());
  absl::StatusOr<std::vector<NamedTensor>> out = ReadTensorFile(path);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ((*out)[i].name, in[i].name);
    EXPECT_EQ((*out)[i].tensor.dtype(), in[i].tensor.dtype());
    EXPECT_EQ((*out)[i].tensor.shape(), in[i].tensor.shape());
    EXPECT_EQ((*out)[i].tensor.bytes(), in[i].tensor.bytes());
  }
}

TEST(TensorFile, EveryCorruptedByteIsDataLoss) {
  const std::string dir = TempDir();
  const std::string path = dir + "/t.bin";
  ASSERT_TRUE(WriteTensorFile(path, SampleTensors()).ok());
  const std::string good = ReadWholeFile(path).value();
  const std::string bad_path = dir + "/bad.bin";
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    WriteRaw(bad_path, bad);
    absl::StatusOr<std::vector<NamedTensor>> r = ReadTensorFile(bad_path);
    ASSERT_FALSE(r.ok()) << "flipping byte " << i << " went unnoticed";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << i << ": " << r.status();
    EXPECT_NE(r.status().message().find(bad_path), std::string::npos) << r.status();
  }
}

TEST(TensorFile, EveryTruncationAndTrailingGarbageIsDataLoss) {
  const std::string dir = TempDir();
  const std::string path = dir + "/t.bin";
  ASSERT_TRUE(WriteTensorFile(path, SampleTensors()).ok());
  const std::string good = ReadWholeFile(path).value();
  const std::string bad_path = dir + "/short.bin";
  for (size_t len = 0; len < good.size(); ++len) {
    WriteRaw(bad_path, good.substr(0, len));
    absl::StatusOr<std::vector<NamedTensor>> r = ReadTensorFile(bad_path);
    ASSERT_FALSE(r.ok()) << "truncation to " << len << " went unnoticed";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  }
  WriteRaw(bad_path, good + "x");
  EXPECT_EQ(ReadTensorFile(bad_path).status().code(), absl::StatusCode::kDataLoss);
}

TEST(TensorFile, FutureVersionIsRefusedClearly) {
  const std::string path = TempDir() + "/t.bin";
  ASSERT_TRUE(WriteTensorFile(path, SampleTensors()).ok());
  std::string data = ReadWholeFile(path).value();
  const uint32_t version = 2;
  std::memcpy(&data[8], &version, 4);
  const uint32_t crc = Crc32c(data.substr(0, 16));
  std::memcpy(&data[16], &crc, 4);
  WriteRaw(path, data);
  absl::Status s = ReadTensorFile(path).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("version 2"), std::string::npos) << s;
}

TEST(TensorFile, MissingFileIsNotFound) {
  EXPECT_EQ(ReadTensorFile(TempDir() + "/absent.bin").status().code(), absl::StatusCode::kNotFound);
}

TEST(TensorFile, RejectsRepeatedNames) {
  const std::string path = TempDir() + "/t.bin";
  Tensor a = Tensor::FromFloats({1}, {1});
  EXPECT_EQ(WriteTensorFile(path, {{"a", a}, {"a", a}}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(AtomicWrite, ReplacesWholeFileAndLeavesNoTemporaries) {
  const std::string dir = TempDir();
  const std::string path = dir + "/f.txt";
  ASSERT_TRUE(WriteFileAtomically(path, {"first version, longer"}).ok());
  ASSERT_TRUE(WriteFileAtomically(path, {"sec", "ond"}).ok());
  EXPECT_EQ(ReadWholeFile(path).value(), "second");
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"f.txt"});
}

TEST(AtomicWrite, FailureLeavesTargetUntouched) {
  const std::string dir = TempDir();
  // The target's directory does not exist: creating the temporary fails, nothing is written.
  absl::Status s = WriteFileAtomically(dir + "/missing/f.txt", {"x"});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_TRUE(ListDir(dir).empty());
}

TEST(MakeDirectories, CreatesParentsAndRejectsFiles) {
  const std::string dir = TempDir();
  EXPECT_TRUE(MakeDirectories(dir + "/a/b/c").ok());
  EXPECT_TRUE(MakeDirectories(dir + "/a/b/c").ok());
  WriteRaw(dir + "/file", "x");
  EXPECT_FALSE(MakeDirectories(dir + "/file").ok());
}

}  // namespace
}  // namespace moe
