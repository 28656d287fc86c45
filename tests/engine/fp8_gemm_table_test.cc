// engine/cuda/fp8_gemm_table.h: the measured choice of fp8_gemms = AUTO on CUDA, looked up
// on the host (no GPU needed): qwen3's shape runs every GEMM in bf16, a shape without an
// entry runs FP8, and the table applies to the GPU kind it was measured on only.
#include "engine/cuda/fp8_gemm_table.h"

#include "gtest/gtest.h"

namespace moe {
namespace cuda {
namespace {

Fp8GemmShape Shape(Fp8Gemm g, int64_t hidden, int64_t ffn, int64_t up, int64_t e, int64_t k) {
  Fp8GemmShape s;
  s.gemm = g, s.hidden = hidden, s.ffn = ffn, s.up = up, s.num_experts = e, s.top_k = k;
  return s;
}

TEST(Fp8GemmTableTest, Qwen3RunsBf16AndOtherShapesHaveNoEntry) {
  for (int i = 0; i < kFp8GemmCount; ++i) {
    const Fp8Gemm g = static_cast<Fp8Gemm>(i);
    EXPECT_EQ(FindFp8GemmChoice(Shape(g, 2048, 768, 1536, 128, 8)), false) << Fp8GemmName(g);
    // Another E, k or F than the measured layer's is not that shape.
    EXPECT_EQ(FindFp8GemmChoice(Shape(g, 2048, 768, 1536, 64, 8)), std::nullopt);
    EXPECT_EQ(FindFp8GemmChoice(Shape(g, 2048, 768, 768, 128, 8)), std::nullopt);
    EXPECT_EQ(FindFp8GemmChoice(Shape(g, 4096, 14336, 28672, 8, 2)), std::nullopt);  // mixtral
  }
}

TEST(Fp8GemmTableTest, AppliesToTheMeasuredGpuKindOnly) {
  EXPECT_TRUE(Fp8GemmTableApplies(9, 0, 132, 130100));
  EXPECT_FALSE(Fp8GemmTableApplies(9, 0, 114, 130100));  // H100 PCIe
  EXPECT_FALSE(Fp8GemmTableApplies(8, 9, 132, 130100));
  EXPECT_FALSE(Fp8GemmTableApplies(9, 0, 132, 120900));
  EXPECT_FALSE(Fp8GemmTableApplies(10, 0, 148, 130100));
}

}  // namespace
}  // namespace cuda
}  // namespace moe
