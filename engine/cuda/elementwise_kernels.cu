// Element-wise kernels of the CUDA backend: activations (forward and backward, gated and
// plain), per-expert bias add and bias gradient (fixed row order), conversion, add, scale and
// the optimizers. Math in fp32; bf16 storage rounds to nearest even.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "engine/cuda/bf16_split.h"
#include "engine/cuda/kernels.cuh"
#include "engine/cuda/type_switch.cuh"
#include "engine/cuda/vec.cuh"

namespace moe {
namespace cuda {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

__device__ __forceinline__ float Act(ActKind act, float x) {
  switch (act) {
    case ActKind::kSilu:
      return x / (1.f + expf(-x));
    case ActKind::kGelu: {
      const float inner = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
      return 0.5f * x * (1.f + tanhf(inner));
    }
    case ActKind::kRelu:
      return x > 0.f ? x : 0.f;
    default:
      return x;
  }
}

__device__ __forceinline__ float ActGrad(ActKind act, float x) {
  switch (act) {
    case ActKind::kSilu: {
      const float sig = 1.f / (1.f + expf(-x));
      return sig * (1.f + x * (1.f - sig));
    }
    case ActKind::kGelu: {
      const float inner = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
      const float th = tanhf(inner);
      return 0.5f * (1.f + th) +
             0.5f * x * (1.f - th * th) * kSqrt2OverPi * (1.f + 3.f * kGeluCoeff * x * x);
    }
    case ActKind::kRelu:
      return x > 0.f ? 1.f : 0.f;
    default:
      return 1.f;
  }
}

// |v| as stored in T (bf16 rounds), for the amax of an output (NaN dropped by fmaxf).
template <typename T>
__device__ __forceinline__ float StoredAbs(float v) {
  return fabsf(ToFloat(FromFloat<T>(v)));
}

// The block's largest `local` into *amax (bits of a non-negative float order like the float:
// an integer atomic max is exact and order-free). blockDim.x a multiple of 32, <= 1024; every
// thread of the block calls it.
__device__ void BlockMaxInto(float local, float* amax) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
  }
  __shared__ float warp_max[32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    float block = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) block = fmaxf(block, warp_max[w]);
    atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(block));
  }
}

// One block per row. amax (nullable): ActivationArgs::amax.
template <int VEC, typename T>
__global__ void ActForwardKernel(ActKind act, bool gated, int64_t ffn, const T* __restrict__ h,
                                 T* __restrict__ a, float* __restrict__ amax) {
  float local = 0.0f;
  const int64_t r = blockIdx.x;
  const int64_t up = gated ? 2 * ffn : ffn;
  const T* hr = h + r * up;
  T* ar = a + r * ffn;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < ffn;
       c += static_cast<int64_t>(blockDim.x) * VEC) {
    float g[VEC], out[VEC];
    LoadVec<VEC>(hr + c, g);
    if (gated) {
      float u[VEC];
      LoadVec<VEC>(hr + ffn + c, u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = Act(act, g[i]) * u[i];
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = Act(act, g[i]);
    }
    StoreVec<VEC>(ar + c, out);
    if (amax != nullptr) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) local = fmaxf(local, StoredAbs<T>(out[i]));
    }
  }
  if (amax != nullptr) BlockMaxInto(local, amax);
}

template <int VEC, typename T>
__global__ void ActBackwardKernel(ActKind act, bool gated, int64_t ffn, const T* __restrict__ h,
                                  const T* __restrict__ d_a, T* __restrict__ d_h,
                                  float* __restrict__ amax) {
  float local = 0.0f;
  const int64_t r = blockIdx.x;
  const int64_t up = gated ? 2 * ffn : ffn;
  const T* hr = h + r * up;
  const T* dar = d_a + r * ffn;
  T* dhr = d_h + r * up;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < ffn;
       c += static_cast<int64_t>(blockDim.x) * VEC) {
    float g[VEC], da[VEC], dg[VEC];
    LoadVec<VEC>(hr + c, g);
    LoadVec<VEC>(dar + c, da);
    if (gated) {
      float u[VEC], du[VEC];
      LoadVec<VEC>(hr + ffn + c, u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        du[i] = da[i] * Act(act, g[i]);
        dg[i] = da[i] * u[i] * ActGrad(act, g[i]);
      }
      StoreVec<VEC>(dhr + ffn + c, du);
      if (amax != nullptr) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) local = fmaxf(local, StoredAbs<T>(du[i]));
      }
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) dg[i] = da[i] * ActGrad(act, g[i]);
    }
    StoreVec<VEC>(dhr + c, dg);
    if (amax != nullptr) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) local = fmaxf(local, StoredAbs<T>(dg[i]));
    }
  }
  if (amax != nullptr) BlockMaxInto(local, amax);
}

// Group of row r in the table (largest g with start[g] <= r).
__device__ __forceinline__ int FindGroup(const GroupTable& t, int64_t r) {
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.start[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T>
__global__ void AddGroupBiasKernel(T* __restrict__ y, const float* __restrict__ bias,
                                   int64_t width, GroupTable table) {
  const int64_t r = table.start[0] + blockIdx.x;
  const int g = FindGroup(table, r);
  T* yr = y + r * width;
  const float* b = bias + static_cast<int64_t>(g) * width;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    yr[c] = FromFloat<T>(ToFloat(yr[c]) + b[c]);
  }
}

template <typename T>
__global__ void GroupBiasGradKernel(const T* __restrict__ d_y, int64_t width, GroupTable table,
                                    float* __restrict__ d_bias) {
  const int g = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= width) return;
  float acc = 0.f;
  for (int64_t r = table.start[g]; r < table.start[g + 1]; ++r) acc += ToFloat(d_y[r * width + c]);
  d_bias[static_cast<int64_t>(g) * width + c] += acc;
}

// Element i of dst = FromFloat<D>(ToFloat(src[i])), VEC elements per thread and step (VEC = 8:
// one 16-byte access per bf16 vector, two per fp32 one; the caller checks alignment and
// count % 8 == 0). The layer converts x (bf16 -> fp32, forward) and d_x (fp32 -> bf16,
// backward): T*H*6 bytes each, e.g. te_seed 201 MB, ~0.05 ms at 4 TB/s; the 2-byte scalar
// form ran at ~2.4 TB/s.
template <int VEC, typename S, typename D>
__global__ void ConvertKernel(const S* __restrict__ src, D* __restrict__ dst, int64_t count) {
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * VEC) {
    float v[VEC];
    LoadVec<VEC>(src + i, v);
    StoreVec<VEC>(dst + i, v);
  }
}

__global__ void AddKernel(float* __restrict__ dst, const float* __restrict__ src, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] += src[i];
  }
}

template <typename T>
__global__ void ScaleKernel(T* data, float alpha, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t n = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    T* p = data + (i / cols) * ld + i % cols;
    *p = alpha == 0.f ? FromFloat<T>(0.f) : FromFloat<T>(alpha * ToFloat(*p));
  }
}

// The bf16 parts (engine/cuda/bf16_split.h) of each fp32 element, as blocks in the order of
// `parts`: beside each other ([rows, count * cols], block s in columns [s * cols, ...)) or,
// with stack_rows, under each other ([count * rows, cols], block s in rows [s * rows, ...)).
__global__ void SplitBf16PartsKernel(const float* __restrict__ src, int64_t rows, int64_t cols,
                                     int64_t ld, Bf16PartList parts, bool stack_rows,
                                     uint16_t* __restrict__ dst) {
  const int64_t n = rows * cols;
  const int64_t count = parts.count;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    uint16_t part[3];
    SplitToBf16x3(src[r * ld + c], &part[0], &part[1], &part[2]);
    for (int64_t s = 0; s < count; ++s) {
      const int64_t at = stack_rows ? (s * rows + r) * cols + c : r * count * cols + s * cols + c;
      dst[at] = part[parts.part[s]];
    }
  }
}

// c = alpha * ((lo + mid) + hi) + beta * c over the three [rows, cols] planes of a
// [rows, 3 * cols] product (hi, mid, lo in that column order); c is not read when beta is 0.
__global__ void SumBf16x3PlanesKernel(const float* __restrict__ planes, int64_t rows,
                                      int64_t cols, float alpha, float beta, float* c,
                                      int64_t ldc) {
  const int64_t n = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, col = i % cols;
    const float* p = planes + r * 3 * cols + col;
    const float sum = (p[2 * cols] + p[cols]) + p[0];
    float* out = c + r * ldc + col;
    *out = beta == 0.f ? alpha * sum : alpha * sum + beta * *out;
  }
}

__global__ void OptimizerKernel(OptimizerParams p, float* __restrict__ param,
                                const float* __restrict__ grad, float* __restrict__ m,
                                float* __restrict__ v, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float w = param[i], g = grad[i] * p.grad_scale;
    if (p.adamw) {
      const float mi = p.beta1 * m[i] + (1.f - p.beta1) * g;
      const float vi = p.beta2 * v[i] + (1.f - p.beta2) * g * g;
      m[i] = mi;
      v[i] = vi;
      const float m_hat = mi / p.bias_correction1, v_hat = vi / p.bias_correction2;
      param[i] = w - p.lr * (m_hat / (sqrtf(v_hat) + p.eps) + p.weight_decay * w);
    } else {
      float step = g + p.weight_decay * w;
      if (m != nullptr) {
        step = p.momentum * m[i] + step;
        m[i] = step;
      }
      param[i] = w - p.lr * step;
    }
  }
}

unsigned GridFor(int64_t n, int threads = 256) {
  return static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 65536));
}

int ThreadsFor(int64_t items) {
  return static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (items + 31) / 32 * 32)));
}

}  // namespace

int LaunchActivationForward(ActKind act, bool gated, int64_t rows, int64_t ffn, KType type,
                            const void* h, void* a, float* amax, void* stream) {
  if (rows == 0 || ffn == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool vec = CanVec8(ffn, h, a);
  const int threads = ThreadsFor(vec ? ffn / 8 : ffn);
  return SwitchVec8(vec, [&](auto v) {
    return SwitchType(type, [&](auto t) {
      using T = typename decltype(t)::type;
      ActForwardKernel<decltype(v)::value, T>
          <<<rows, threads, 0, s>>>(act, gated, ffn, static_cast<const T*>(h), static_cast<T*>(a),
                                    amax);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

int LaunchActivationBackward(ActKind act, bool gated, int64_t rows, int64_t ffn, KType type,
                             const void* h, const void* d_a, void* d_h, float* amax,
                             void* stream) {
  if (rows == 0 || ffn == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool vec = CanVec8(ffn, h, d_a, d_h);
  const int threads = ThreadsFor(vec ? ffn / 8 : ffn);
  return SwitchVec8(vec, [&](auto v) {
    return SwitchType(type, [&](auto t) {
      using T = typename decltype(t)::type;
      ActBackwardKernel<decltype(v)::value, T>
          <<<rows, threads, 0, s>>>(act, gated, ffn, static_cast<const T*>(h),
                                    static_cast<const T*>(d_a), static_cast<T*>(d_h), amax);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

int LaunchAddGroupBias(void* y, KType type, const float* bias, int64_t width,
                       const GroupTable& table, void* stream) {
  const int64_t rows = table.count > 0 ? table.start[table.count] - table.start[0] : 0;
  if (rows == 0 || width == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int threads = ThreadsFor(width);
  return SwitchType(type, [&](auto t) {
    using T = typename decltype(t)::type;
    AddGroupBiasKernel<T><<<rows, threads, 0, s>>>(static_cast<T*>(y), bias, width, table);
    return static_cast<int>(cudaGetLastError());
  });
}

int LaunchGroupBiasGrad(const void* d_y, KType type, int64_t width, const GroupTable& table,
                        float* d_bias, void* stream) {
  if (table.count == 0 || width == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  dim3 grid(static_cast<unsigned>((width + 127) / 128), table.count);
  return SwitchType(type, [&](auto t) {
    using T = typename decltype(t)::type;
    GroupBiasGradKernel<T><<<grid, 128, 0, s>>>(static_cast<const T*>(d_y), width, table, d_bias);
    return static_cast<int>(cudaGetLastError());
  });
}

int LaunchConvert(const void* src, KType src_type, void* dst, KType dst_type, int64_t count,
                  void* stream) {
  if (count == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return SwitchTypes(src_type, dst_type, [&](auto src_tag, auto dst_tag) {
    using S = typename decltype(src_tag)::type;
    using D = typename decltype(dst_tag)::type;
    if constexpr (std::is_same_v<S, D>) {
      return static_cast<int>(
          cudaMemcpyAsync(dst, src, count * sizeof(S), cudaMemcpyDeviceToDevice, s));
    } else {
      const bool vec = CanVec8(count, src, dst);
      return SwitchVec8(vec, [&](auto v) {
        constexpr int kVec = decltype(v)::value;
        ConvertKernel<kVec, S, D><<<GridFor(count / kVec), 256, 0, s>>>(
            static_cast<const S*>(src), static_cast<D*>(dst), count);
        return static_cast<int>(cudaGetLastError());
      });
    }
  });
}

int LaunchAddInPlace(float* dst, const float* src, int64_t count, void* stream) {
  if (count == 0) return cudaSuccess;
  AddKernel<<<GridFor(count), 256, 0, static_cast<cudaStream_t>(stream)>>>(dst, src, count);
  return cudaGetLastError();
}

int LaunchScale(void* data, KType type, float alpha, int64_t rows, int64_t cols, int64_t ld,
                void* stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return SwitchType(type, [&](auto t) {
    using T = typename decltype(t)::type;
    ScaleKernel<T>
        <<<GridFor(rows * cols), 256, 0, s>>>(static_cast<T*>(data), alpha, rows, cols, ld);
    return static_cast<int>(cudaGetLastError());
  });
}

int LaunchSplitBf16Parts(const float* src, int64_t rows, int64_t cols, int64_t ld,
                         const Bf16PartList& parts, bool stack_rows, void* dst, void* stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (parts.count < 1 || parts.count > Bf16PartList::kMax) return cudaErrorInvalidValue;
  for (int s = 0; s < parts.count; ++s) {
    if (parts.part[s] < 0 || parts.part[s] > 2) return cudaErrorInvalidValue;
  }
  SplitBf16PartsKernel<<<GridFor(rows * cols), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      src, rows, cols, ld, parts, stack_rows, static_cast<uint16_t*>(dst));
  return cudaGetLastError();
}

int LaunchSumBf16x3Planes(const float* planes, int64_t rows, int64_t cols, float alpha,
                          float beta, float* c, int64_t ldc, void* stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  SumBf16x3PlanesKernel<<<GridFor(rows * cols), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      planes, rows, cols, alpha, beta, c, ldc);
  return cudaGetLastError();
}

int LaunchOptimizerStep(const OptimizerParams& p, float* param, const float* grad,
                        float* state1, float* state2, int64_t count, void* stream) {
  if (count == 0) return cudaSuccess;
  OptimizerKernel<<<GridFor(count), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      p, param, grad, state1, state2, count);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace moe
