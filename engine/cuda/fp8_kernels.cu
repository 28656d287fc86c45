// FP8 quantisation kernels (docs/SPEC.md "FP8"): per-matrix amax on the device, the scale
// amax / fp8_max, and the cast to e4m3/e5m2 (round to nearest even, saturating), written
// as stored or transposed. The codes and scales are bitwise those of the CPU emulation
// (engine/fp8.h): the division is IEEE round-to-nearest (__fdiv_rn) and the cast is the
// hardware's cvt.rn.satfinite.
//
// Layout: `batch` matrices [rows, cols] back to back in src; dst has the same layout, or each
// matrix transposed ([cols, rows]) with `transpose`. Grouped (LaunchQuantizeFp8Grouped, one
// matrix): the codes also go to dst_grouped_t [cols, ld], each group's rows transposed into
// its own 16-aligned run of columns followed by zero pads (engine/backend.h QuantizeArgs). amax scratch: one uint32 per matrix (the
// bits of a non-negative float order like the float, so atomicMax on them is exact and
// order-free: the result is deterministic).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
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

// Every thread of the block calls it: *amax_out = max(*amax_out, the block's largest `local`)
// (delayed scaling's amax of this step, reduced while the codes are written; amax_out may be
// null). Blocks of at most kThreads threads.
__device__ __forceinline__ void ReduceAmaxOut(float local, uint32_t* amax_out) {
  if (amax_out == nullptr) return;  // uniform over the block
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
  }
  __shared__ float warp_max[kThreads / 32];
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int warps = (blockDim.x * blockDim.y + 31) / 32;
  if (tid % 32 == 0) warp_max[tid / 32] = local;
  __syncthreads();
  if (tid == 0) {
    float block = 0.0f;
    for (int w = 0; w < warps; ++w) block = fmaxf(block, warp_max[w]);
    atomicMax(amax_out, __float_as_uint(block));
  }
}

// One block of kThreads: engine/backend.h Fp8HistoryArgs (engine/fp8.h Fp8DelayedAmax).
__global__ void HistoryAmaxKernel(float* __restrict__ history, int64_t len, int64_t steps,
                                  int margin, bool most_recent, float* __restrict__ amax) {
  float local = 0.0f;
  if (steps > 0 && most_recent) {
    if (threadIdx.x == 0) local = history[(steps - 1) % len];
  } else {
    const int64_t filled = steps < len ? steps : len;
    for (int64_t i = threadIdx.x; i < filled; i += blockDim.x) local = fmaxf(local, history[i]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
  }
  __shared__ float warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();  // every read of the history is done before its slot is zeroed
  if (threadIdx.x == 0) {
    float block = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) block = fmaxf(block, warp_max[w]);
    *amax = ldexpf(block, margin);
    history[steps % len] = 0.0f;
  }
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

// The groups of one grouped launch, passed by value: group g's source rows
// [row_start[g], row_start[g + 1]) go to the columns from col_start[g] on; col_start[count] ends
// the launch's columns (the pads of the last group included).
struct GroupedColumns {
  int count = 0;
  int64_t row_start[kMaxTableGroups + 1] = {};
  int64_t col_start[kMaxTableGroups + 1] = {};
};

// Source row of destination column j, or -1 for a pad column (j inside the table's columns).
__device__ int64_t SourceRowOfColumn(const GroupedColumns& t, int64_t j) {
  // The last group starting at or before j (an empty group shares its start with the next).
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.col_start[mid] <= j) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t i = j - t.col_start[lo];
  return i < t.row_start[lo + 1] - t.row_start[lo] ? t.row_start[lo] + i : -1;
}

// grid (destination column tiles, source column tiles), block (kTile, 8): tiles of the grouped
// destination dst_t[c, j] = code(src[row(j), c]) (0 on pads), and dst[row(j), c] when dst is
// set. Reads go along a source row, both writes along kTile consecutive bytes. Block (0, 0)
// writes the scale.
template <typename T>
__global__ void CastGroupedKernel(const T* __restrict__ src, int64_t cols,
                                  const uint32_t* __restrict__ amax, Fp8Kind fp8,
                                  uint8_t* __restrict__ dst, uint8_t* __restrict__ dst_t,
                                  int64_t ld_t, float* __restrict__ scale_out,
                                  GroupedColumns table, uint32_t* __restrict__ amax_out) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // [j][c]; +4: conflict-free column reads
  __shared__ int64_t source_row[kTile];
  const float scale = ScaleFromAmax(amax[0], fp8);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    *scale_out = scale;
  }
  const int64_t j_end = table.col_start[table.count];
  const int64_t j0 = table.col_start[0] + static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  if (threadIdx.y == 0) {
    const int64_t j = j0 + threadIdx.x;
    source_row[threadIdx.x] = j < j_end ? SourceRowOfColumn(table, j) : -1;
  }
  __syncthreads();
  float local = 0.0f;
  for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
    const int64_t r = source_row[i], c = c0 + threadIdx.x;
    uint8_t code = 0;
    if (r >= 0 && c < cols) {
      const float v = ToFloat(src[r * cols + c]);
      local = fmaxf(local, fabsf(v));
      code = Cast(v, scale, fp8);
      if (dst != nullptr) dst[r * cols + c] = code;
    }
    tile[i][threadIdx.x] = code;
  }
  ReduceAmaxOut(local, amax_out);
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
    const int64_t c = c0 + i, j = j0 + threadIdx.x;
    if (c < cols && j < j_end) dst_t[c * ld_t + j] = tile[threadIdx.x][i];
  }
}

// The wide form of CastGroupedKernel, for 16-byte aligned rows (cols % 8 == 0, src, dst,
// dst_t and ld_t aligned): a block covers kWideJ destination columns x kWideC source columns
// with 16-byte loads (8 elements) and 8-byte stores of 8 codes in both layouts, i.e. 16 KiB of
// bf16 in per block instead of 2 KiB; the same Cast of the same values, so the same codes.
constexpr int kWideJ = 64, kWideC = 128;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    CastGroupedWideKernel(const T* __restrict__ src, int64_t cols,
                          const uint32_t* __restrict__ amax, Fp8Kind fp8,
                          uint8_t* __restrict__ dst, uint8_t* __restrict__ dst_t, int64_t ld_t,
                          float* __restrict__ scale_out, GroupedColumns table,
                          uint32_t* __restrict__ amax_out) {
  __shared__ __align__(8) uint8_t tile[kWideJ][kWideC + 8];  // [j][c], rows 8-byte aligned
  __shared__ int64_t source_row[kWideJ];
  const float scale = ScaleFromAmax(amax[0], fp8);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_out = scale;
  const int64_t j_end = table.col_start[table.count];
  const int64_t j0 = table.col_start[0] + static_cast<int64_t>(blockIdx.x) * kWideJ;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kWideC;
  if (threadIdx.x < kWideJ) {
    const int64_t j = j0 + threadIdx.x;
    source_row[threadIdx.x] = j < j_end ? SourceRowOfColumn(table, j) : -1;
  }
  __syncthreads();
  constexpr int kVecs = kWideC / 8;  // 8-element vectors per tile row
  float local = 0.0f;
  for (int i = threadIdx.x; i < kWideJ * kVecs; i += blockDim.x) {
    const int jl = i / kVecs, v = i % kVecs;
    const int64_t r = source_row[jl], c = c0 + v * 8;
    uint2 codes = make_uint2(0, 0);
    if (r >= 0 && c < cols) {
      float f[8];
      Load8(src + r * cols + c, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) local = fmaxf(local, fabsf(f[e]));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        codes.x |= static_cast<uint32_t>(Cast(f[e], scale, fp8)) << (8 * e);
        codes.y |= static_cast<uint32_t>(Cast(f[e + 4], scale, fp8)) << (8 * e);
      }
      if (dst != nullptr) *reinterpret_cast<uint2*>(dst + r * cols + c) = codes;
    }
    *reinterpret_cast<uint2*>(&tile[jl][v * 8]) = codes;
  }
  ReduceAmaxOut(local, amax_out);
  __syncthreads();
  constexpr int kRuns = kWideJ / 8;  // 8-byte runs of destination columns per tile row
  for (int i = threadIdx.x; i < kWideC * kRuns; i += blockDim.x) {
    const int cl = i / kRuns, run = i % kRuns;
    const int64_t c = c0 + cl, j = j0 + run * 8;
    if (c >= cols || j >= j_end) continue;
    uint2 codes = make_uint2(0, 0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      codes.x |= static_cast<uint32_t>(tile[run * 8 + e][cl]) << (8 * e);
      codes.y |= static_cast<uint32_t>(tile[run * 8 + e + 4][cl]) << (8 * e);
    }
    *reinterpret_cast<uint2*>(dst_t + c * ld_t + j) = codes;
  }
}

int BlocksFor(int64_t elements, int vec) {
  const int64_t blocks = (elements + static_cast<int64_t>(kThreads) * vec - 1) /
                         (static_cast<int64_t>(kThreads) * vec);
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks));
}

// Zeroes the amax words, then reduces each matrix's amax into them.
int LaunchAmax(const void* src, KType src_type, int64_t batch, int64_t per_matrix,
               uint32_t* amax, cudaStream_t s) {
  int err = static_cast<int>(cudaMemsetAsync(amax, 0, batch * sizeof(uint32_t), s));
  if (err != 0 || per_matrix == 0) return err;
  const size_t elem = src_type == KType::kBF16 ? 2 : 4;
  const bool vec = per_matrix % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                   (per_matrix * elem) % 16 == 0;
  const dim3 grid(BlocksFor(per_matrix, vec ? 8 : 1), static_cast<unsigned>(batch));
  return SwitchType(src_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return SwitchVec8(vec, [&](auto vtag) {
      AmaxKernel<decltype(vtag)::value, T>
          <<<grid, kThreads, 0, s>>>(static_cast<const T*>(src), per_matrix, amax);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

// Writes scale[0] (no codes): for a grouped quantisation with nothing to cast.
template <typename T>
int LaunchScaleOnly(const uint32_t* amax, Fp8Kind fp8, float* scale, cudaStream_t s) {
  CastKernel<1, T><<<1, 32, 0, s>>>(nullptr, 0, amax, fp8, nullptr, scale, 1);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LaunchQuantizeFp8Grouped(const void* src, KType src_type, int64_t rows, int64_t cols,
                             const int64_t* group_rows, int64_t groups, Fp8Kind fp8,
                             uint8_t* dst, uint8_t* dst_grouped_t, int64_t ld_grouped,
                             float* scale, const float* known_amax, float* amax_out,
                             void* scratch, void* stream) {
  if ((cols + kTile - 1) / kTile > 65535) return static_cast<int>(cudaErrorInvalidValue);
  uint32_t* amax_out_bits = reinterpret_cast<uint32_t*>(amax_out);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint32_t* amax = reinterpret_cast<const uint32_t*>(known_amax);
  if (known_amax == nullptr) {
    uint32_t* reduced = static_cast<uint32_t*>(scratch);
    const int err = LaunchAmax(src, src_type, 1, rows * cols, reduced, s);
    if (err != 0) return err;
    amax = reduced;
  }
  // 16-byte rows in, 8-byte runs out (CastGroupedWideKernel); else the scalar tiles.
  const bool wide = cols % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dst) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(dst_grouped_t) % 8 == 0 && ld_grouped % 8 == 0;
  return SwitchType(src_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    bool cast = false;
    int64_t row = 0, column = 0;
    for (int64_t first = 0; first < groups && rows * cols > 0; first += kMaxTableGroups) {
      GroupedColumns table;
      table.count = static_cast<int>(std::min<int64_t>(kMaxTableGroups, groups - first));
      for (int g = 0; g <= table.count; ++g) {
        table.row_start[g] = row;
        table.col_start[g] = column;
        if (g == table.count) break;
        row += group_rows[first + g];
        column += (group_rows[first + g] + 15) / 16 * 16;  // engine/backend.h Fp8PaddedRows
      }
      const int64_t columns = column - table.col_start[0];
      if (columns == 0) continue;
      if (wide) {
        const dim3 grid(static_cast<unsigned>((columns + kWideJ - 1) / kWideJ),
                        static_cast<unsigned>((cols + kWideC - 1) / kWideC));
        CastGroupedWideKernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(src), cols,
                                                           amax, fp8, dst, dst_grouped_t,
                                                           ld_grouped, scale, table,
                                                           amax_out_bits);
      } else {
        const dim3 grid(static_cast<unsigned>((columns + kTile - 1) / kTile),
                        static_cast<unsigned>((cols + kTile - 1) / kTile));
        CastGroupedKernel<T><<<grid, dim3(kTile, 8), 0, s>>>(
            static_cast<const T*>(src), cols, amax, fp8, dst, dst_grouped_t, ld_grouped, scale,
            table, amax_out_bits);
      }
      const int e = static_cast<int>(cudaGetLastError());
      if (e != 0) return e;
      cast = true;
    }
    return cast ? 0 : LaunchScaleOnly<T>(amax, fp8, scale, s);
  });
}

int LaunchFp8HistoryAmax(float* history, int64_t len, int64_t steps, int margin,
                         bool most_recent, float* amax, void* stream) {
  HistoryAmaxKernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      history, len, steps, margin, most_recent, amax);
  return static_cast<int>(cudaGetLastError());
}

size_t QuantizeScratchBytes(int64_t batch) { return static_cast<size_t>(batch) * sizeof(uint32_t); }

int LaunchQuantizeFp8(const void* src, KType src_type, int64_t batch, int64_t rows, int64_t cols,
                      bool transpose, Fp8Kind fp8, uint8_t* dst, float* scale,
                      int64_t scale_stride, const float* known_amax, float* amax_out,
                      void* scratch, void* stream) {
  if (batch <= 0) return 0;
  if ((known_amax != nullptr || amax_out != nullptr) && batch != 1) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  uint32_t* reduced = static_cast<uint32_t*>(scratch);
  const uint32_t* amax =
      known_amax != nullptr ? reinterpret_cast<const uint32_t*>(known_amax) : reduced;
  if (known_amax == nullptr) {
    const int err = static_cast<int>(cudaMemsetAsync(reduced, 0, QuantizeScratchBytes(batch), s));
    if (err != 0) return err;
  }
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
      if (known_amax == nullptr) {
        AmaxKernel<V, T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(src), per_matrix, reduced);
      }
      // Not fused here (the layer quantises through the grouped path): an amax pass of its own.
      if (amax_out != nullptr) {
        AmaxKernel<V, T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(src), per_matrix,
                                                   reinterpret_cast<uint32_t*>(amax_out));
      }
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
