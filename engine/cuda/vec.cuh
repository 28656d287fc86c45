// Device helpers shared by the CUDA kernels: 8-wide loads/stores of fp32 or bf16 as floats
// (one 16-byte access for bf16, two for fp32) and scalar conversions. bf16 stores round to
// nearest even, like engine/dtype.h's FloatToBf16. Device code only (include from .cu files).
#ifndef MOED_ENGINE_CUDA_VEC_CUH_
#define MOED_ENGINE_CUDA_VEC_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moe {
namespace cuda {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// p must be 16-byte aligned (8 bf16 or 8 fp32 elements from an aligned base).
__device__ __forceinline__ void Load8(const float* p, float* f) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void Load8(const __nv_bfloat16* p, float* f) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ void Store8(float* p, const float* f) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void Store8(__nv_bfloat16* p, const float* f) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// Loads/stores VEC (1 or 8) elements at p as floats.
template <int VEC, typename T>
__device__ __forceinline__ void LoadVec(const T* p, float* f) {
  if constexpr (VEC == 8) {
    Load8(p, f);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = ToFloat(p[i]);
  }
}
template <int VEC, typename T>
__device__ __forceinline__ void StoreVec(T* p, const float* f) {
  if constexpr (VEC == 8) {
    Store8(p, f);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = FromFloat<T>(f[i]);
  }
}

// 8-wide access needs width % 8 == 0 and 16-byte aligned bases.
inline bool CanVec8(int64_t width, const void* a, const void* b = nullptr,
                    const void* c = nullptr) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return width % 8 == 0 && aligned(a) && aligned(b) && aligned(c);
}

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_VEC_CUH_
