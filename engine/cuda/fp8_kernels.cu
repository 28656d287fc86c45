// FP8 quantisation kernels (docs/SPEC.md "FP8"): per-matrix amax on the device, the scale
// amax / fp8_max, and the cast to e4m3/e5m2 (round to nearest even, saturating), written
// as stored or transposed. The codes and scales are bitwise those of the CPU emulation
// (engine/fp8.h): the division is IEEE round-to-nearest (__fdiv_rn) and the cast is the
// hardware's cvt.rn.satfinite.
//
// Layout: `batch` matrices [rows, cols] back to back in src; dst has the same layout, or each
// matrix transposed ([cols, rows]) with `transpose`. amax scratch: one uint32 per matrix (the
// bits of a non-negative float order like the float, so atomicMax on them is exact and
// order-free: the result is deterministic).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "engine/cuda/kernels.cuh"
#include "engine/cuda/type_switch.cuh"
#include "engine/cuda/vec.cuh"

namespace moe {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 32;  // transpose tile

__device__ __forceinline__ float Fp8MaxOf(Fp8Kind fp8) {
  return fp8 == Fp8Kind::kE4M3 ? 448.0f : 57344.0f;
}

// engine/fp8.h Fp8Scale.
__device__ __forceinline__ float ScaleFromAmax(uint32_t amax_bits, Fp8Kind fp8) {
  const float scale = __fdiv_rn(__uint_as_float(amax_bits), Fp8MaxOf(fp8));
  return isfinite(scale) && scale >= FLT_MIN ? scale : 1.0f;
}

__device__ __forceinline__ uint8_t Cast(float v, float scale, Fp8Kind fp8) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(v, scale), __NV_SATFINITE,
                                                    fp8 == Fp8Kind::kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

// grid (blocks per matrix, batch): amax[b] = max |x| over matrix b (fmaxf drops NaN).
template <int VEC, typename T>
__global__ void AmaxKernel(const T* __restrict__ src, int64_t per_matrix,
                           uint32_t* __restrict__ amax) {
  const T* m = src + blockIdx.y * per_matrix;
  float local = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
       i < per_matrix; i += stride) {
    float v[VEC];
    LoadVec<VEC>(m + i, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) local = fmaxf(local, fabsf(v[j]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
  }
  __shared__ float warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    float block = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) block = fmaxf(block, warp_max[w]);
    atomicMax(amax + blockIdx.y, __float_as_uint(block));
  }
}

// grid (blocks per matrix, batch): the cast, as stored. Block (0, b) writes
// scale[b * scale_stride].
template <int VEC, typename T>
__global__ void CastKernel(const T* __restrict__ src, int64_t per_matrix,
                           const uint32_t* __restrict__ amax, Fp8Kind fp8,
                           uint8_t* __restrict__ dst, float* __restrict__ scale_out,
                           int64_t scale_stride) {
  const float scale = ScaleFromAmax(amax[blockIdx.y], fp8);
  if (blockIdx.x == 0 && threadIdx.x == 0) scale_out[blockIdx.y * scale_stride] = scale;
  const T* m = src + blockIdx.y * per_matrix;
  uint8_t* d = dst + blockIdx.y * per_matrix;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
       i < per_matrix; i += stride) {
    float v[VEC];
    LoadVec<VEC>(m + i, v);
    if constexpr (VEC == 8) {
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo |= static_cast<uint32_t>(Cast(v[j], scale, fp8)) << (8 * j);
        hi |= static_cast<uint32_t>(Cast(v[j + 4], scale, fp8)) << (8 * j);
      }
      *reinterpret_cast<uint2*>(d + i) = make_uint2(lo, hi);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) d[i + j] = Cast(v[j], scale, fp8);
    }
  }
}

// grid (col tiles, row tiles, batch), block (kTile, 8): dst_b[c, r] = cast(src_b[r, c]).
template <typename T>
__global__ void CastTransposeKernel(const T* __restrict__ src, int64_t rows, int64_t cols,
                                    const uint32_t* __restrict__ amax, Fp8Kind fp8,
                                    uint8_t* __restrict__ dst, float* __restrict__ scale_out,
                                    int64_t scale_stride) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t b = blockIdx.z;
  const float scale = ScaleFromAmax(amax[b], fp8);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    scale_out[b * scale_stride] = scale;
  }
  const T* m = src + b * rows * cols;
  uint8_t* d = dst + b * rows * cols;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = Cast(ToFloat(m[r * cols + c]), scale, fp8);
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) d[c * rows + r] = tile[threadIdx.x][i];
  }
}

int BlocksFor(int64_t elements, int vec) {
  const int64_t blocks = (elements + static_cast<int64_t>(kThreads) * vec - 1) /
                         (static_cast<int64_t>(kThreads) * vec);
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks));
}

}  // namespace

size_t QuantizeScratchBytes(int64_t batch) { return static_cast<size_t>(batch) * sizeof(uint32_t); }

int LaunchQuantizeFp8(const void* src, KType src_type, int64_t batch, int64_t rows, int64_t cols,
                      bool transpose, Fp8Kind fp8, uint8_t* dst, float* scale,
                      int64_t scale_stride, void* scratch,
                      void* stream) {
  if (batch <= 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  uint32_t* amax = static_cast<uint32_t*>(scratch);
  int err = static_cast<int>(cudaMemsetAsync(amax, 0, QuantizeScratchBytes(batch), s));
  if (err != 0) return err;
  const int64_t per_matrix = rows * cols;
  if (batch > 65535) return static_cast<int>(cudaErrorInvalidValue);
  // 8-wide when every matrix starts 16-byte aligned in src and 8-byte aligned in dst.
  const size_t elem = src_type == KType::kBF16 ? 2 : 4;
  const bool vec = per_matrix % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                   (per_matrix * elem) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  const dim3 grid(BlocksFor(per_matrix, vec ? 8 : 1), static_cast<unsigned>(batch));
  if (per_matrix == 0) {
    // Nothing to reduce or cast; the scales are still written (1).
    return SwitchType(src_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      CastKernel<1, T><<<dim3(1, static_cast<unsigned>(batch)), 32, 0, s>>>(
          static_cast<const T*>(src), 0, amax, fp8, dst, scale, scale_stride);
      return static_cast<int>(cudaGetLastError());
    });
  }
  return SwitchType(src_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return SwitchVec8(vec, [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      AmaxKernel<V, T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(src), per_matrix, amax);
      if (transpose) {
        const dim3 tgrid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                         static_cast<unsigned>((rows + kTile - 1) / kTile),
                         static_cast<unsigned>(batch));
        CastTransposeKernel<T><<<tgrid, dim3(kTile, 8), 0, s>>>(static_cast<const T*>(src), rows,
                                                                cols, amax, fp8, dst, scale,
                                                                scale_stride);
      } else {
        CastKernel<V, T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(src), per_matrix, amax,
                                                   fp8, dst, scale, scale_stride);
      }
      return static_cast<int>(cudaGetLastError());
    });
  });
}

}  // namespace cuda
}  // namespace moe
