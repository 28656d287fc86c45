// Capacity plan, permutation, row gathers and the fp32 combine (docs/SPEC.md Forward 7-8, 11 and
// Backward 1), all deterministic: integer atomics only, fixed-order float reductions.
//
// Permute is a stable counting sort of the (token, slot) pairs, enumerated i = t * k + j:
//   1. HistogramKernel: per chunk of kChunk pairs, kept pairs per expert -> hist[chunk, E].
//   2. ChunkBaseKernel: per expert, exclusive scan over chunks from expert_offsets[e].
//   3. ScatterKernel: one warp per chunk walks it in order, 32 pairs a step; lanes with the
//      same expert are ranked by __match_any_sync, so rows follow pair order (token, slot).
// The capacity plan sorts (expert, prob descending) keys with CUB's stable radix sort, so
// among equal probabilities the earlier token is kept.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "engine/cuda/kernels.cuh"
#include "engine/cuda/type_switch.cuh"
#include "engine/cuda/vec.cuh"

namespace moe {
namespace cuda {
namespace {

constexpr int kChunk = 1024;

size_t AlignUp(size_t v) { return (v + 255) / 256 * 256; }

__global__ void HistogramKernel(int64_t pairs, int E, const int32_t* __restrict__ expert,
                                const uint8_t* __restrict__ kept, int32_t* __restrict__ hist) {
  extern __shared__ int32_t counts[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(begin + kChunk, pairs);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    if (kept == nullptr || kept[i]) atomicAdd(&counts[expert[i]], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    hist[static_cast<int64_t>(blockIdx.x) * E + e] = counts[e];
  }
}

__global__ void ChunkBaseKernel(int chunks, int E, const int64_t* __restrict__ expert_offsets,
                                const int32_t* __restrict__ hist, int64_t* __restrict__ base) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int64_t running = expert_offsets[e];
  for (int c = 0; c < chunks; ++c) {
    base[static_cast<int64_t>(c) * E + e] = running;
    running += hist[static_cast<int64_t>(c) * E + e];
  }
}

__global__ void ScatterKernel(int64_t pairs, int top_k, int E, const int32_t* __restrict__ expert,
                              const uint8_t* __restrict__ kept, const int64_t* __restrict__ base,
                              int32_t* __restrict__ pair_row, int32_t* __restrict__ row_token) {
  extern __shared__ int64_t cursor[];
  const int lane = threadIdx.x;
  for (int e = lane; e < E; e += 32) cursor[e] = base[static_cast<int64_t>(blockIdx.x) * E + e];
  __syncwarp();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(begin + kChunk, pairs);
  for (int64_t step = begin; step < end; step += 32) {
    const int64_t i = step + lane;
    const bool valid = i < end && kept[i];
    const int key = valid ? expert[i] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, key);
    const unsigned lower = (1u << lane) - 1u;
    const int rank = __popc(same & lower);
    if (valid) {
      const int64_t row = cursor[key] + rank;
      pair_row[i] = static_cast<int32_t>(row);
      row_token[row] = static_cast<int32_t>(i / top_k);
    } else if (i < end) {
      pair_row[i] = -1;
    }
    __syncwarp();
    if (valid && rank == 0) cursor[key] += __popc(same);
    __syncwarp();
  }
}

// ---- capacity plan ----
__device__ __forceinline__ uint32_t DescendingKey(float v) {
  uint32_t u = __float_as_uint(v);
  u ^= (u & 0x80000000u) ? 0xffffffffu : 0x80000000u;  // ascending order of floats
  return ~u;                                          // descending
}

__global__ void PlanKeysKernel(int64_t pairs, const int32_t* __restrict__ expert,
                               const float* __restrict__ weight, uint64_t* __restrict__ keys,
                               int32_t* __restrict__ values, int32_t* __restrict__ counts) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  const int e = expert[i];
  keys[i] = (static_cast<uint64_t>(e) << 32) | DescendingKey(weight[i]);
  values[i] = static_cast<int32_t>(i);
  atomicAdd(&counts[e], 1);
}

__global__ void PlanStartsKernel(int E, int64_t capacity, const int32_t* __restrict__ counts,
                                 int64_t* __restrict__ starts, int32_t* __restrict__ kept_counts) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t running = 0;
  for (int e = 0; e < E; ++e) {
    starts[e] = running;
    running += counts[e];
    kept_counts[e] = static_cast<int32_t>(min(static_cast<int64_t>(counts[e]), capacity));
  }
}

__global__ void PlanKeepKernel(int64_t pairs, int64_t capacity, const uint64_t* __restrict__ keys,
                               const int32_t* __restrict__ values,
                               const int64_t* __restrict__ starts, uint8_t* __restrict__ kept) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  const int e = static_cast<int>(keys[i] >> 32);
  kept[values[i]] = (i - starts[e]) < capacity ? 1 : 0;
}

__global__ void FillKeptKernel(int64_t pairs, const int32_t* __restrict__ expert,
                               uint8_t* __restrict__ kept, int32_t* __restrict__ counts) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  kept[i] = 1;
  atomicAdd(&counts[expert[i]], 1);
}

size_t CubSortBytes(int64_t pairs) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint64_t*>(nullptr),
                                  static_cast<uint64_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(pairs));
  return bytes;
}

// ---- gathers and combine ----
template <typename V>
__global__ void GatherRowsKernel(const V* __restrict__ src, const int32_t* __restrict__ index,
                                 int64_t vecs_per_row, V* __restrict__ dst) {
  const int64_t r = blockIdx.x;
  const int32_t s = index[r];
  V* out = dst + r * vecs_per_row;
  if (s < 0) {
    V zero;
    memset(&zero, 0, sizeof(V));
    for (int64_t c = threadIdx.x; c < vecs_per_row; c += blockDim.x) out[c] = zero;
    return;
  }
  const V* in = src + static_cast<int64_t>(s) * vecs_per_row;
  for (int64_t c = threadIdx.x; c < vecs_per_row; c += blockDim.x) out[c] = in[c];
}

// One block per token: its row is read once (16-byte vectors) and written to each of its kept
// pairs' rows. Bytes: T*H + T*k*H elements (qwen3 bf16: 67 + 537 MB, ~0.15 ms at 4 TB/s;
// dsv3: 117 + 940 MB, ~0.26 ms), where the row-side gather reads every token row k times
// from DRAM (x is larger than L2 and the rows of one expert hold distinct tokens).
__global__ void ScatterTokenRowsKernel(const uint4* __restrict__ src,
                                       const int32_t* __restrict__ pair_row, int top_k,
                                       int64_t vecs_per_row, uint4* __restrict__ dst) {
  const int64_t t = blockIdx.x;
  const uint4* in = src + t * vecs_per_row;
  const int32_t* rows = pair_row + t * top_k;
  for (int64_t c = threadIdx.x; c < vecs_per_row; c += blockDim.x) {
    const uint4 v = in[c];
    for (int j = 0; j < top_k; ++j) {
      const int32_t r = rows[j];
      if (r >= 0) dst[static_cast<int64_t>(r) * vecs_per_row + c] = v;
    }
  }
}

// Zero rows (align_size padding, row_token < 0): one warp per row, grid-stride over rows.
__global__ void ZeroPaddingRowsKernel(const int32_t* __restrict__ row_token, int64_t rows,
                                      int64_t vecs_per_row, uint4* __restrict__ dst) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       r < rows; r += warps) {
    if (row_token[r] >= 0) continue;
    uint4* out = dst + r * vecs_per_row;
    for (int64_t c = lane; c < vecs_per_row; c += 32) out[c] = make_uint4(0, 0, 0, 0);
  }
}

template <typename V>
__global__ void CopyRowBlocksKernel(const V* __restrict__ src, V* __restrict__ dst,
                                    int64_t vecs_per_row, RowBlockTable table) {
  const int b = blockIdx.y;
  const int64_t total = table.rows[b] * vecs_per_row;
  const V* in = src + table.src_row[b] * vecs_per_row;
  V* out = dst + table.dst_row[b] * vecs_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i];
  }
}

// One block per token, each thread its columns, the slots one after the other. Loading a
// token's slots' rows together instead (as CombineBackwardKernel does) was measured twice on
// the H200 and doubled this kernel's time for k = 8 (qwen3 0.31 -> 0.62 ms, dsv3 0.55 -> 1.08;
// history/PERFORMANCE-2026-11-29_12-03.md, "Tried and reverted: the combine's slots loaded
// together").
template <int VEC, typename Y, typename O>
__global__ void CombineKernel(const Y* __restrict__ y, const int32_t* __restrict__ pair_row,
                              const float* __restrict__ weight, int top_k, int64_t width,
                              O* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < width;
       c += static_cast<int64_t>(blockDim.x) * VEC) {
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
    for (int j = 0; j < top_k; ++j) {
      const int32_t row = pair_row[t * top_k + j];
      if (row < 0) continue;
      const float w = weight ? weight[t * top_k + j] : 1.f;
      float v[VEC];
      LoadVec<VEC>(y + static_cast<int64_t>(row) * width + c, v);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += w * v[i];
    }
    StoreVec<VEC>(out + t * width + c, acc);
  }
}

// Slots of a token that CombineBackwardKernel handles in one pass over the row: 2, 4 or 8, the
// smallest that covers top_k up to 8 (registers grow with it: ~60 at 2 slots, ~120 at 8).
int CombineSlotsFor(int top_k) { return top_k <= 2 ? 2 : top_k <= 4 ? 4 : 8; }

// VEC elements of T as loaded (one 16-byte access for 8 bf16, two for 8 fp32), converted to
// float only when used, so that several rows' loads can be in flight at once.
template <int VEC, typename T>
struct alignas(VEC == 8 ? 16 : alignof(T)) RawVec {
  T v[VEC];
};
template <int VEC, typename T>
__device__ __forceinline__ RawVec<VEC, T> LoadRaw(const T* p) {
  return *reinterpret_cast<const RawVec<VEC, T>*>(p);
}
template <int VEC, typename T>
__device__ __forceinline__ void RawToFloat(const RawVec<VEC, T>& r, float* f) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) f[i] = ToFloat(r.v[i]);
}

// One block per token t. For slots j0..j0+SLOTS-1 at once: d_out_t is read once per
// pass and the slots' y rows are loaded together (up to SLOTS + 1 independent 16-byte
// loads in flight per thread, where one slot at a time with a block barrier between slots
// left ~2). Bytes per token: H * sizeof(D) + 2 * k * H * sizeof(Y) (qwen3 bf16: 1.14 GB,
// ~0.29 ms at 4 TB/s; dsv3: 2.0 GB, ~0.50 ms). The arithmetic and the order of every sum are
// those of the one-slot-at-a-time form: each thread adds g*v over its own columns in column
// order, then the warp's xor-shuffle tree, then the warps' sums in warp order (thread j adds
// slot j's), so d_probs are bitwise unchanged.
template <int VEC, int SLOTS, typename D, typename Y>
__global__ void CombineBackwardKernel(const D* __restrict__ d_out, const Y* __restrict__ y,
                                      const int32_t* __restrict__ pair_row,
                                      const float* __restrict__ weight, int top_k, int64_t width,
                                      Y* __restrict__ d_y, float* __restrict__ d_weight) {
  __shared__ float warp_sums[SLOTS][32];
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int j0 = 0; j0 < top_k; j0 += SLOTS) {
    const int n = min(SLOTS, top_k - j0);
    int32_t rows[SLOTS];
    float w[SLOTS], dot[SLOTS];
#pragma unroll
    for (int jj = 0; jj < SLOTS; ++jj) {
      rows[jj] = jj < n ? pair_row[t * top_k + j0 + jj] : -1;
      w[jj] = jj < n && weight ? weight[t * top_k + j0 + jj] : 1.f;
      dot[jj] = 0.f;
    }
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < width;
         c += static_cast<int64_t>(blockDim.x) * VEC) {
      float g[VEC];
      LoadVec<VEC>(d_out + t * width + c, g);
      RawVec<VEC, Y> raw[SLOTS];
#pragma unroll
      for (int jj = 0; jj < SLOTS; ++jj) {
        if (rows[jj] >= 0) raw[jj] = LoadRaw<VEC>(y + static_cast<int64_t>(rows[jj]) * width + c);
      }
#pragma unroll
      for (int jj = 0; jj < SLOTS; ++jj) {
        if (rows[jj] < 0) continue;
        float v[VEC], o[VEC];
        RawToFloat(raw[jj], v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          dot[jj] += g[i] * v[i];
          o[i] = w[jj] * g[i];
        }
        StoreVec<VEC>(d_y + static_cast<int64_t>(rows[jj]) * width + c, o);
      }
    }
#pragma unroll
    for (int jj = 0; jj < SLOTS; ++jj) {
      for (int o = 16; o > 0; o >>= 1) dot[jj] += __shfl_xor_sync(0xffffffffu, dot[jj], o);
      if (lane == 0) warp_sums[jj][warp] = dot[jj];
    }
    __syncthreads();
    if (threadIdx.x < n) {
      const int jj = threadIdx.x;
      float total = 0.f;
      for (int i = 0; i < warps; ++i) total += warp_sums[jj][i];
      // A dropped pair (row < 0) gets 0: its partial sums are all 0.f, and 0.f + 0.f == 0.f.
      d_weight[t * top_k + j0 + jj] = total;
    }
    __syncthreads();
  }
}

template <int VEC, typename Y, typename O>
void LaunchCombineTyped(const void* y, const int32_t* pair_row, const float* weight,
                        int64_t tokens, int top_k, int64_t width, void* out, cudaStream_t s) {
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (width / VEC + 31) / 32 * 32)));
  CombineKernel<VEC, Y, O><<<tokens, threads, 0, s>>>(static_cast<const Y*>(y), pair_row, weight,
                                                      top_k, width, static_cast<O*>(out));
}

template <int VEC, typename D, typename Y>
void LaunchCombineBackwardTyped(const void* d_out, const void* y, const int32_t* pair_row,
                                const float* weight, int64_t tokens, int top_k, int64_t width,
                                void* d_y, float* d_weight, cudaStream_t s) {
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (width / VEC + 31) / 32 * 32)));
  auto launch = [&](auto kernel) {
    kernel<<<tokens, threads, 0, s>>>(static_cast<const D*>(d_out), static_cast<const Y*>(y),
                                      pair_row, weight, top_k, width, static_cast<Y*>(d_y),
                                      d_weight);
  };
  switch (CombineSlotsFor(top_k)) {
    case 2:
      return launch(CombineBackwardKernel<VEC, 2, D, Y>);
    case 4:
      return launch(CombineBackwardKernel<VEC, 4, D, Y>);
    default:
      return launch(CombineBackwardKernel<VEC, 8, D, Y>);
  }
}

}  // namespace

size_t RoutePlanScratchBytes(int64_t pairs, int num_experts) {
  return 2 * AlignUp(pairs * sizeof(uint64_t)) + 2 * AlignUp(pairs * sizeof(int32_t)) +
         AlignUp(num_experts * sizeof(int32_t)) + AlignUp(num_experts * sizeof(int64_t)) +
         AlignUp(CubSortBytes(pairs));
}

int LaunchRoutePlan(int64_t tokens, int top_k, int num_experts, int64_t capacity,
                    const int32_t* topk_expert, const float* topk_weight, uint8_t* kept,
                    int32_t* kept_counts, void* scratch, size_t scratch_bytes, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t pairs = tokens * top_k;
  const int blocks = static_cast<int>((pairs + 255) / 256);
  if (capacity < 0) {
    cudaError_t err = cudaMemsetAsync(kept_counts, 0, num_experts * sizeof(int32_t), s);
    if (err != cudaSuccess) return err;
    if (pairs > 0) FillKeptKernel<<<blocks, 256, 0, s>>>(pairs, topk_expert, kept, kept_counts);
    return cudaGetLastError();
  }
  char* p = static_cast<char*>(scratch);
  auto take = [&p](size_t bytes) {
    char* out = p;
    p += AlignUp(bytes);
    return out;
  };
  uint64_t* keys_in = reinterpret_cast<uint64_t*>(take(pairs * sizeof(uint64_t)));
  uint64_t* keys_out = reinterpret_cast<uint64_t*>(take(pairs * sizeof(uint64_t)));
  int32_t* vals_in = reinterpret_cast<int32_t*>(take(pairs * sizeof(int32_t)));
  int32_t* vals_out = reinterpret_cast<int32_t*>(take(pairs * sizeof(int32_t)));
  int32_t* counts = reinterpret_cast<int32_t*>(take(num_experts * sizeof(int32_t)));
  int64_t* starts = reinterpret_cast<int64_t*>(take(num_experts * sizeof(int64_t)));
  size_t cub_bytes = scratch_bytes - static_cast<size_t>(p - static_cast<char*>(scratch));
  cudaError_t err = cudaMemsetAsync(counts, 0, num_experts * sizeof(int32_t), s);
  if (err != cudaSuccess) return err;
  if (pairs > 0) {
    PlanKeysKernel<<<blocks, 256, 0, s>>>(pairs, topk_expert, topk_weight, keys_in, vals_in,
                                          counts);
    int end_bit = 32;
    while ((1ll << (end_bit - 32)) < num_experts) ++end_bit;
    err = cub::DeviceRadixSort::SortPairs(p, cub_bytes, keys_in, keys_out, vals_in, vals_out,
                                          static_cast<int>(pairs), 0, end_bit, s);
    if (err != cudaSuccess) return err;
  }
  PlanStartsKernel<<<1, 32, 0, s>>>(num_experts, capacity, counts, starts, kept_counts);
  if (pairs > 0) {
    PlanKeepKernel<<<blocks, 256, 0, s>>>(pairs, capacity, keys_out, vals_out, starts, kept);
  }
  return cudaGetLastError();
}

size_t PermuteScratchBytes(int64_t pairs, int num_experts) {
  const int64_t chunks = (pairs + kChunk - 1) / kChunk;
  return AlignUp(chunks * num_experts * sizeof(int32_t)) +
         AlignUp(chunks * num_experts * sizeof(int64_t));
}

int LaunchPermute(int64_t tokens, int top_k, int num_experts, int64_t total_rows,
                  const int32_t* topk_expert, const uint8_t* kept, const int64_t* expert_offsets,
                  int32_t* pair_row, int32_t* row_token, void* scratch, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t pairs = tokens * top_k;
  if (total_rows > 0) {
    cudaError_t err = cudaMemsetAsync(row_token, 0xff, total_rows * sizeof(int32_t), s);
    if (err != cudaSuccess) return err;
  }
  if (pairs == 0) return cudaGetLastError();
  const int chunks = static_cast<int>((pairs + kChunk - 1) / kChunk);
  int32_t* hist = static_cast<int32_t*>(scratch);
  int64_t* base = reinterpret_cast<int64_t*>(static_cast<char*>(scratch) +
                                             AlignUp(chunks * num_experts * sizeof(int32_t)));
  if (static_cast<size_t>(num_experts) * sizeof(int64_t) > 48 * 1024) return cudaErrorInvalidValue;
  HistogramKernel<<<chunks, 256, num_experts * sizeof(int32_t), s>>>(pairs, num_experts,
                                                                     topk_expert, kept, hist);
  ChunkBaseKernel<<<(num_experts + 127) / 128, 128, 0, s>>>(chunks, num_experts, expert_offsets,
                                                            hist, base);
  ScatterKernel<<<chunks, 32, num_experts * sizeof(int64_t), s>>>(
      pairs, top_k, num_experts, topk_expert, kept, base, pair_row, row_token);
  return cudaGetLastError();
}

int LaunchGatherRows(const void* src, const int32_t* index, int64_t rows, int64_t row_bytes,
                     void* dst, void* stream) {
  if (rows == 0 || row_bytes == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (row_bytes % 16 == 0 && CanVec8(8, src, dst)) {
    const int64_t vecs = row_bytes / 16;
    GatherRowsKernel<uint4><<<rows, static_cast<int>(std::min<int64_t>(256, (vecs + 31) / 32 * 32)), 0, s>>>(
        static_cast<const uint4*>(src), index, vecs, static_cast<uint4*>(dst));
  } else if (row_bytes % 4 == 0) {
    GatherRowsKernel<uint32_t><<<rows, 256, 0, s>>>(static_cast<const uint32_t*>(src), index,
                                                    row_bytes / 4, static_cast<uint32_t*>(dst));
  } else {
    GatherRowsKernel<uint8_t><<<rows, 256, 0, s>>>(static_cast<const uint8_t*>(src), index,
                                                   row_bytes, static_cast<uint8_t*>(dst));
  }
  return cudaGetLastError();
}

int LaunchScatterTokenRows(const void* src, const int32_t* pair_row, int64_t tokens, int top_k,
                           const int32_t* row_token, int64_t rows, int64_t row_bytes, void* dst,
                           void* stream) {
  if (row_bytes % 16 != 0 || !CanVec8(8, src, dst)) return cudaErrorInvalidValue;
  if (row_bytes == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t vecs = row_bytes / 16;
  if (rows > 0) {
    const int64_t blocks = std::min<int64_t>((rows + 7) / 8, 4096);
    ZeroPaddingRowsKernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(row_token, rows, vecs,
                                                                        static_cast<uint4*>(dst));
  }
  if (tokens > 0) {
    const int threads = static_cast<int>(std::min<int64_t>(256, (vecs + 31) / 32 * 32));
    ScatterTokenRowsKernel<<<static_cast<unsigned>(tokens), threads, 0, s>>>(
        static_cast<const uint4*>(src), pair_row, top_k, vecs, static_cast<uint4*>(dst));
  }
  return cudaGetLastError();
}

int LaunchCopyRowBlocks(const void* src, void* dst, int64_t row_bytes, const RowBlockTable& table,
                        void* stream) {
  if (table.count == 0 || row_bytes == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int64_t max_rows = 0;
  for (int i = 0; i < table.count; ++i) max_rows = std::max(max_rows, table.rows[i]);
  if (max_rows == 0) return cudaSuccess;
  const bool aligned16 = row_bytes % 16 == 0 && CanVec8(8, src, dst);
  const int64_t vecs_per_row = aligned16 ? row_bytes / 16 : row_bytes;
  const int64_t grid_x = std::min<int64_t>(1024, (max_rows * vecs_per_row + 255) / 256);
  dim3 grid(static_cast<unsigned>(grid_x), table.count);
  if (aligned16) {
    CopyRowBlocksKernel<uint4><<<grid, 256, 0, s>>>(static_cast<const uint4*>(src),
                                                    static_cast<uint4*>(dst), vecs_per_row, table);
  } else {
    CopyRowBlocksKernel<uint8_t><<<grid, 256, 0, s>>>(
        static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), vecs_per_row, table);
  }
  return cudaGetLastError();
}

int LaunchCombineRows(const void* y, KType y_type, const int32_t* pair_row, const float* weight,
                      int64_t tokens, int top_k, int64_t width, void* out, KType out_type,
                      void* stream) {
  if (tokens == 0 || width == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool vec = CanVec8(width, y, out);
  return SwitchVec8(vec, [&](auto v) {
    return SwitchTypes(y_type, out_type, [&](auto y_tag, auto out_tag) {
      LaunchCombineTyped<decltype(v)::value, typename decltype(y_tag)::type,
                         typename decltype(out_tag)::type>(y, pair_row, weight, tokens, top_k,
                                                           width, out, s);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

int LaunchCombineBackward(const void* d_out, KType d_out_type, const void* y, KType y_type,
                          const int32_t* pair_row, const float* weight, int64_t tokens,
                          int top_k, int64_t width, void* d_y, float* d_weight, void* stream) {
  if (tokens == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool vec = CanVec8(width, d_out, y, d_y);
  return SwitchVec8(vec, [&](auto v) {
    return SwitchTypes(d_out_type, y_type, [&](auto d_out_tag, auto y_tag) {
      LaunchCombineBackwardTyped<decltype(v)::value, typename decltype(d_out_tag)::type,
                                 typename decltype(y_tag)::type>(d_out, y, pair_row, weight, tokens,
                                                                 top_k, width, d_y, d_weight, s);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

}  // namespace cuda
}  // namespace moe
