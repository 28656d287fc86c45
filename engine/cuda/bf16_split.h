// An fp32 value as the exact sum of three bf16 values, for fp32 GEMMs on bf16 tensor cores.
//
// Truncation (round toward zero) to bf16 keeps the top 8 of a float's 24 significant bits and
// leaves a residual v - hi that is exact in fp32 (Sterbenz) and has at most 16 significant
// bits; truncating that keeps 8 more and leaves at most 8, which the third bf16 holds exactly.
// So v == hi + mid + lo for every finite v whose lowest significant bit is at or above bf16's
// smallest subnormal (2^-133): every normal float above 2^-110 and most below. A GEMM with
// one bf16 operand A and one fp32 operand B is then A·B == A·B_hi + A·B_mid + A·B_lo with
// every product exact in fp32: the products an fp32 GEMM sums, summed by the tensor cores'
// fp32 accumulation instead (the CUDA backend's Gemm with GemmArgs::a_bf16; docs/SPEC.md,
// "Parameters", and docs/DECISIONS.md "router GEMMs" for the measured accuracy).
// Infinities and NaN go to hi with zero mid and lo; truncation never rounds a finite value up
// to infinity.
//
// Host and device code (nvcc and the host compiler): tests/engine/bf16_split_test.cc checks
// the identity on the host, the CUDA split kernel calls the same function.
//
//   uint16_t hi, mid, lo;
//   moe::cuda::SplitToBf16x3(v, &hi, &mid, &lo);   // bf16 bit patterns
#ifndef MOED_ENGINE_CUDA_BF16_SPLIT_H_
#define MOED_ENGINE_CUDA_BF16_SPLIT_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOED_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MOED_HOST_DEVICE inline
#endif

namespace moe {
namespace cuda {

MOED_HOST_DEVICE uint32_t FloatBits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
#endif
}

MOED_HOST_DEVICE float BitsFloat(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
#endif
}

// The bf16 of v rounded toward zero, as bf16 bits; the value it stands for is *as_float.
MOED_HOST_DEVICE uint16_t TruncateToBf16(float v, float* as_float) {
  const uint32_t bits = FloatBits(v) & 0xffff0000u;
  *as_float = BitsFloat(bits);
  return static_cast<uint16_t>(bits >> 16);
}

MOED_HOST_DEVICE void SplitToBf16x3(float v, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  const uint32_t bits = FloatBits(v);
  if ((bits & 0x7f800000u) == 0x7f800000u) {  // inf or NaN: all in hi (NaN stays NaN)
    *hi = static_cast<uint16_t>(bits >> 16) | ((bits & 0x007fffffu) != 0 ? 0x0040u : 0u);
    *mid = *lo = 0;
    return;
  }
  float part;
  *hi = TruncateToBf16(v, &part);
  const float r1 = v - part;
  *mid = TruncateToBf16(r1, &part);
  const float r2 = r1 - part;
  *lo = TruncateToBf16(r2, &part);
}

}  // namespace cuda
}  // namespace moe

#undef MOED_HOST_DEVICE

#endif  // MOED_ENGINE_CUDA_BF16_SPLIT_H_
