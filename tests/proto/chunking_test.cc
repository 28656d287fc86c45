// Named tensors as TensorChunk streams (proto/chunking.h): splitting, and reassembling with
// and without a list of expected tensors.
#include "proto/chunking.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/proto/iota_tensor.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

std::vector<v1::TensorChunk> Chunks(const std::string& name, const Tensor& t,
                                    int64_t max_chunk_bytes) {
  std::vector<v1::TensorChunk> chunks;
  absl::Status s = ChunkTensor(name, t, max_chunk_bytes, [&](v1::TensorChunk&& c) {
    chunks.push_back(std::move(c));
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  return chunks;
}

TEST(ChunkTensorTest, SplitsIntoWholeElements) {
  const Tensor a = IotaTensor(DType::kFloat32, {5, 7});  // 140 bytes
  auto chunks = Chunks("a", a, 48);                      // 12 elements per chunk -> 12, 12, 11
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[1].element_offset(), 12);
  EXPECT_EQ(chunks[2].raw_data().size(), 44u);
  for (const auto& c : chunks) {
    EXPECT_EQ(c.name(), "a");
    EXPECT_EQ(c.datatype(), "FP32");
    EXPECT_THAT(c.shape(), ::testing::ElementsAre(5, 7));  // the whole tensor's shape
  }
  // Smaller than one element: one element per chunk.
  EXPECT_EQ(Chunks("c", IotaTensor(DType::kInt64, {2}), 3).size(), 2u);
  // Without elements: one empty chunk.
  auto empty = Chunks("b", IotaTensor(DType::kFloat32, {0, 3}), 48);
  ASSERT_EQ(empty.size(), 1u);
  EXPECT_TRUE(empty[0].raw_data().empty());
  // 0 (a request that leaves it unset) means kDefaultChunkBytes.
  const Tensor big = IotaTensor(DType::kFloat32, {kDefaultChunkBytes / 4 + 1});
  auto defaulted = Chunks("big", big, 0);
  ASSERT_EQ(defaulted.size(), 2u);
  EXPECT_EQ(static_cast<int64_t>(defaulted[0].raw_data().size()), kDefaultChunkBytes);
}

TEST(ChunkTensorTest, StopsAtTheFirstEmitError) {
  int calls = 0;
  absl::Status s = ChunkTensor("a", IotaTensor(DType::kFloat32, {16}), 4, [&](v1::TensorChunk&&) {
    return ++calls == 2 ? absl::CancelledError("reader gone") : absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(calls, 2);
}

TEST(ChunkAssemblerTest, ReassemblesAnyTensorsInArrivalOrder) {
  const Tensor a = IotaTensor(DType::kFloat32, {5, 7});
  const Tensor b = IotaTensor(DType::kFloat32, {0, 3});
  const Tensor c = IotaTensor(DType::kInt64, {2});
  ChunkAssembler assembler;
  for (const auto& list : {Chunks("a", a, 48), Chunks("b", b, 48), Chunks("c", c, 3)}) {
    for (const auto& chunk : list) ASSERT_TRUE(assembler.Add(chunk).ok());
  }
  absl::StatusOr<std::vector<NamedTensor>> tensors = assembler.Finish();
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 3u);
  EXPECT_EQ((*tensors)[0].name, "a");
  EXPECT_EQ((*tensors)[0].tensor.bytes(), a.bytes());
  EXPECT_EQ((*tensors)[1].tensor.shape(), b.shape());
  EXPECT_EQ((*tensors)[2].tensor.dtype(), DType::kInt64);
  EXPECT_EQ((*tensors)[2].tensor.bytes(), c.bytes());
}

TEST(ChunkAssemblerTest, ReassemblesExpectedTensorsAlsoInterleaved) {
  const Tensor wi = IotaTensor(DType::kFloat32, {5, 3});
  const Tensor gate = IotaTensor(DType::kFloat32, {4});
  auto wi_chunks = Chunks("wi", wi, 16);  // 4 elements per chunk
  auto gate_chunks = Chunks("gate", gate, 8);
  ASSERT_EQ(wi_chunks.size(), 4u);
  ASSERT_EQ(gate_chunks.size(), 2u);
  ChunkAssembler assembler({{"wi", ExpectedTensor{DType::kFloat32, {5, 3}}},
                            {"gate", ExpectedTensor{DType::kFloat32, {4}}}});
  for (const auto* chunk : {&wi_chunks[0], &gate_chunks[0], &wi_chunks[1], &wi_chunks[2],
                            &gate_chunks[1], &wi_chunks[3]}) {
    ASSERT_TRUE(assembler.Add(*chunk).ok());
  }
  auto tensors = assembler.Finish();
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 2u);
  EXPECT_EQ((*tensors)[0].name, "wi");
  EXPECT_EQ((*tensors)[0].tensor.bytes(), wi.bytes());
  EXPECT_EQ((*tensors)[1].tensor.bytes(), gate.bytes());
}

// Errors common to both kinds of assembler, checked on each.
TEST(ChunkAssemblerTest, RejectsBrokenStreams) {
  const Tensor t = IotaTensor(DType::kFloat32, {4, 4});
  auto chunks = Chunks("a", t, 16);  // 4 chunks
  ASSERT_EQ(chunks.size(), 4u);
  const auto make = [](bool expected) {
    return expected ? ChunkAssembler({{"a", ExpectedTensor{DType::kFloat32, {4, 4}}}})
                    : ChunkAssembler();
  };
  for (bool expected : {false, true}) {
    SCOPED_TRACE(expected ? "expected tensors" : "any tensors");
    {
      ChunkAssembler a = make(expected);  // out of order
      EXPECT_THAT(a.Add(chunks[1]).message(), HasSubstr("element_offset"));
    }
    {
      ChunkAssembler a = make(expected);  // gap
      ASSERT_TRUE(a.Add(chunks[0]).ok());
      EXPECT_EQ(a.Add(chunks[2]).code(), absl::StatusCode::kInvalidArgument);
    }
    {
      ChunkAssembler a = make(expected);  // incomplete at the end
      ASSERT_TRUE(a.Add(chunks[0]).ok());
      absl::Status s = a.Finish().status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(s.message(), HasSubstr("incomplete"));
    }
    {
      ChunkAssembler a = make(expected);  // shape changes mid-tensor
      ASSERT_TRUE(a.Add(chunks[0]).ok());
      v1::TensorChunk bad = chunks[1];
      bad.set_shape(0, 8);
      EXPECT_THAT(a.Add(bad).message(), HasSubstr("shape"));
    }
    {
      ChunkAssembler a = make(expected);  // datatype changes mid-tensor
      ASSERT_TRUE(a.Add(chunks[0]).ok());
      v1::TensorChunk bad = chunks[1];
      bad.set_datatype("INT32");
      EXPECT_THAT(a.Add(bad).message(), HasSubstr("datatype"));
    }
    {
      ChunkAssembler a = make(expected);  // the same tensor twice
      for (const auto& chunk : chunks) ASSERT_TRUE(a.Add(chunk).ok());
      EXPECT_THAT(a.Add(chunks[0]).message(), HasSubstr("already complete"));
    }
    {
      ChunkAssembler a = make(expected);  // overrun
      v1::TensorChunk big = chunks[3];
      big.set_element_offset(0);
      big.mutable_raw_data()->append(std::string(64, 'x'));
      EXPECT_THAT(a.Add(big).message(), HasSubstr("runs past the end"));
    }
    {
      ChunkAssembler a = make(expected);  // partial elements
      v1::TensorChunk ragged = chunks[0];
      ragged.mutable_raw_data()->pop_back();
      EXPECT_THAT(a.Add(ragged).message(), HasSubstr("whole number"));
    }
  }
}

TEST(ChunkAssemblerTest, ExpectedTensorsOnly) {
  auto chunks = Chunks("gate", IotaTensor(DType::kFloat32, {4}), 8);
  {
    ChunkAssembler a({{"wo", ExpectedTensor{DType::kFloat32, {4}}}});
    absl::Status s = a.Add(chunks[0]);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("unknown tensor name (expected one of wo)"));
  }
  {
    ChunkAssembler a({{"gate", ExpectedTensor{DType::kFloat32, {5}}}});
    EXPECT_THAT(a.Add(chunks[0]).message(), HasSubstr("shape"));
  }
  {
    ChunkAssembler a({{"gate", ExpectedTensor{DType::kBFloat16, {4}}}});
    EXPECT_THAT(a.Add(chunks[0]).message(), HasSubstr("expected BF16"));
  }
}

TEST(ChunkAssemblerTest, AnyTensorRefusesShapesItCannotAllocate) {
  v1::TensorChunk huge;
  huge.set_name("huge");
  huge.set_datatype("FP32");
  huge.add_shape(-1);
  huge.add_shape(-4);
  EXPECT_THAT(ChunkAssembler().Add(huge).message(), HasSubstr("negative dimension"));
  // An element count that overflows int64 ((2^62 + 1) * 4 wraps to 4) must not yield a
  // 4-element tensor claiming that shape, nor try to allocate it.
  huge.set_shape(0, (int64_t{1} << 62) + 1);
  huge.set_shape(1, 4);
  huge.set_raw_data(std::string(16, '\0'));
  EXPECT_THAT(ChunkAssembler().Add(huge).message(), HasSubstr("too large"));
  huge.set_shape(0, int64_t{1} << 62);  // wraps to 0 elements
  huge.clear_raw_data();
  EXPECT_EQ(ChunkAssembler().Add(huge).code(), absl::StatusCode::kInvalidArgument);
  huge.set_datatype("FP8");
  EXPECT_THAT(ChunkAssembler().Add(huge).message(), HasSubstr("unknown datatype"));
}

}  // namespace
}  // namespace moe
