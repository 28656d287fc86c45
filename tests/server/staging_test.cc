// Staged tensors' book (server/staging.h) without a cluster: parts in any order and at once,
// incomplete, overlapping and mismatched parts, owners, the byte cap, outputs fetched in
// ranges and freed, expiry, and sub-slices across slice boundaries.
#include "server/staging.h"

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

constexpr int64_t kHidden = 4;
constexpr int64_t kRowBytes = kHidden * 4;  // FP32

v1::Tensor Head(int64_t rows, const char* datatype = "FP32", int64_t hidden = kHidden) {
  v1::Tensor head;
  head.set_datatype(datatype);
  head.add_shape(rows);
  head.add_shape(hidden);
  return head;
}

// Rows [first, first + n) of the test tensor: row r holds bytes of value r.
std::string Rows(int64_t first, int64_t n) {
  std::string bytes;
  for (int64_t r = first; r < first + n; ++r) bytes += std::string(kRowBytes, static_cast<char>(r));
  return bytes;
}

std::string Joined(const std::vector<grpc::Slice>& slices) {
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

class StagingTest : public ::testing::Test {
 protected:
  absl::Status Stage(const std::string& owner, const std::string& name, int64_t total,
                     int64_t first, int64_t n, const char* datatype = "FP32") {
    const std::string bytes = Rows(first, n);
    return table_.Stage(owner, name, total, first, Head(n, datatype), TensorBytes(bytes));
  }

  RelayPool pool_{int64_t{64} << 20};
  StagingTable table_{&pool_, int64_t{8} << 20, absl::Seconds(60)};
};

TEST_F(StagingTest, PartsInAnyOrderAndConcurrently) {
  std::vector<std::thread> lanes;
  std::vector<absl::Status> results(4);
  for (int i = 3; i >= 0; --i) {
    lanes.emplace_back([&, i] { results[i] = Stage("alice", "x", 40, 10 * i, 10); });
  }
  for (std::thread& t : lanes) t.join();
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(table_.TakeInput("bob", "x", kHidden).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<StagedInput> x = table_.TakeInput("alice", "x", kHidden);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(x->rows, 40);
  EXPECT_EQ(x->dtype, DType::kFloat32);
  EXPECT_EQ(std::string(x->buffer->data, x->bytes()), Rows(0, 40));
  // Taken: gone from the book.
  EXPECT_EQ(table_.TakeInput("alice", "x", kHidden).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table_.staged_bytes(), 0);
}

TEST_F(StagingTest, RefusesBadParts) {
  ASSERT_TRUE(Stage("a", "x", 10, 0, 5).ok());
  EXPECT_EQ(Stage("a", "x", 10, 4, 2).code(), absl::StatusCode::kInvalidArgument);  // overlap
  EXPECT_EQ(Stage("a", "x", 10, 0, 5).code(), absl::StatusCode::kInvalidArgument);  // again
  EXPECT_EQ(Stage("a", "x", 12, 5, 5).code(), absl::StatusCode::kInvalidArgument);  // total
  EXPECT_EQ(Stage("a", "x", 10, 5, 5, "BF16").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Stage("a", "x", 10, 8, 5).code(), absl::StatusCode::kInvalidArgument);  // past end
  EXPECT_EQ(Stage("a", "x", 10, -1, 5).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Stage("a", "bad name", 10, 0, 5).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Stage("a", "y", 0, 0, 1).code(), absl::StatusCode::kInvalidArgument);
  const std::string short_bytes = Rows(0, 1).substr(1);
  EXPECT_EQ(table_.Stage("a", "z", 4, 0, Head(1), TensorBytes(short_bytes)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table_.Stage("a", "z", 4, 0, Head(1, "INT32"), TensorBytes(Rows(0, 1))).code(),
            absl::StatusCode::kInvalidArgument);
  // Incomplete: FAILED_PRECONDITION, and dropped.
  EXPECT_EQ(table_.TakeInput("a", "x", kHidden).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_.TakeInput("a", "x", kHidden).status().code(), absl::StatusCode::kNotFound);
  // Another hidden size than the layer's.
  ASSERT_TRUE(Stage("a", "w", 2, 0, 2).ok());
  EXPECT_EQ(table_.TakeInput("a", "w", kHidden + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(StagingTest, CapAndOffSwitch) {
  // 8 MiB cap: a tensor of 9 MiB is refused before any buffer is taken.
  const int64_t rows = (int64_t{9} << 20) / kRowBytes;
  EXPECT_EQ(Stage("a", "big", rows, 0, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool_.mapped_bytes(), 0);
  StagingTable off(nullptr, 1 << 20, absl::Seconds(1));
  EXPECT_EQ(off.Stage("a", "x", 1, 0, Head(1), TensorBytes(Rows(0, 1))).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(off.CheckOutputName("a", "o").code(), absl::StatusCode::kUnimplemented);
}

TEST_F(StagingTest, OutputsAreFetchedInRangesThenFreed) {
  const std::string all = Rows(0, 10);
  std::vector<grpc::Slice> slices;  // split at a byte that is not a row boundary
  slices.emplace_back(all.data(), 23);
  slices.emplace_back(all.data() + 23, all.size() - 23);
  ASSERT_TRUE(table_.CheckOutputName("a", "o").ok());
  ASSERT_TRUE(table_.PutOutput("a", "o", DType::kFloat32, 10, kHidden, slices).ok());
  EXPECT_EQ(table_.CheckOutputName("a", "o").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(Stage("a", "o", 10, 0, 1).code(), absl::StatusCode::kAlreadyExists);
  v1::Tensor head;
  std::vector<grpc::Slice> got;
  EXPECT_EQ(table_.Fetch("b", "o", 0, 1, &head, &got).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table_.Fetch("a", "o", 8, 3, &head, &got).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(table_.Fetch("a", "o", 1, 4, &head, &got).ok());
  EXPECT_EQ(Joined(got), Rows(1, 4));
  EXPECT_EQ(head.shape(0), 4);
  EXPECT_EQ(head.datatype(), "FP32");
  got.clear();
  ASSERT_TRUE(table_.Fetch("a", "o", 1, 4, &head, &got).ok());  // a retry: counted once
  got.clear();
  ASSERT_TRUE(table_.Fetch("a", "o", 5, 5, &head, &got).ok());
  got.clear();
  ASSERT_TRUE(table_.Fetch("a", "o", 0, 1, &head, &got).ok());  // the last row: freed
  EXPECT_EQ(Joined(got), Rows(0, 1));
  EXPECT_EQ(table_.Fetch("a", "o", 0, 1, &head, &got).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table_.staged_bytes(), 0);
}

TEST_F(StagingTest, UnusedTensorsExpire) {
  StagingTable table(&pool_, 1 << 20, absl::Seconds(60));
  ASSERT_TRUE(table.Stage("a", "x", 2, 0, Head(1), TensorBytes(Rows(0, 1))).ok());
  table.DropExpired(absl::Now());
  EXPECT_GT(table.staged_bytes(), 0);
  table.DropExpired(absl::Now() + absl::Seconds(61));
  EXPECT_EQ(table.staged_bytes(), 0);
  EXPECT_EQ(table.TakeInput("a", "x", kHidden).status().code(), absl::StatusCode::kNotFound);
}

TEST(AppendSubSlicesTest, CutsAcrossSlices) {
  const std::string all = "abcdefghij";
  std::vector<grpc::Slice> slices = {grpc::Slice(all.data(), 3), grpc::Slice(all.data() + 3, 4),
                                     grpc::Slice(all.data() + 7, 3)};
  for (size_t offset = 0; offset <= all.size(); ++offset) {
    for (size_t length = 0; offset + length <= all.size(); ++length) {
      std::vector<grpc::Slice> out;
      AppendSubSlices(slices, offset, length, &out);
      EXPECT_EQ(Joined(out), all.substr(offset, length)) << offset << " " << length;
    }
  }
}

}  // namespace
}  // namespace moe
