// Compile-time switches for the CUDA launchers (device code; include from .cu files only):
// one place turns a runtime KType or vector width into a template argument, instead of an
// if/else chain written out per launcher and per type combination. Models:
// TransformerEngine's TRANSFORMER_ENGINE_TYPE_SWITCH_* and DeepEP's SWITCH_* (launch.cuh).
//
// The callable gets a tag; its `type` (TypeTag) or `value` (VecTag) is the compile-time
// argument. Every switch returns what the callable returns (a cudaError_t as int here) and
// cudaErrorInvalidValue for a KType outside the enum (the host side, cuda_backend_ops.cc,
// already refuses other dtypes with INVALID_ARGUMENT before any launch).
//
//   return SwitchType(type, [&](auto tag) {
//     using T = typename decltype(tag)::type;
//     ScaleKernel<T><<<grid, 256, 0, s>>>(static_cast<T*>(data), alpha, rows, cols, ld);
//     return static_cast<int>(cudaGetLastError());
//   });
#ifndef MOED_ENGINE_CUDA_TYPE_SWITCH_CUH_
#define MOED_ENGINE_CUDA_TYPE_SWITCH_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <utility>

#include "engine/cuda/kernels.cuh"

namespace moe {
namespace cuda {

template <typename T>
struct TypeTag {
  using type = T;
};
template <int N>
struct VecTag {
  static constexpr int value = N;
};

// fn(TypeTag<float>) for KType::kF32, fn(TypeTag<__nv_bfloat16>) for KType::kBF16.
template <typename Fn>
int SwitchType(KType type, Fn&& fn) {
  switch (type) {
    case KType::kF32:
      return std::forward<Fn>(fn)(TypeTag<float>{});
    case KType::kBF16:
      return std::forward<Fn>(fn)(TypeTag<__nv_bfloat16>{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

// Two types at once (e.g. input and output of a combine): fn(TypeTag<A>, TypeTag<B>).
template <typename Fn>
int SwitchTypes(KType a, KType b, Fn&& fn) {
  return SwitchType(a, [&](auto ta) {
    return SwitchType(b, [&](auto tb) { return fn(ta, tb); });
  });
}

// fn(VecTag<8>) when `vec` (8-wide 16-byte accesses are possible, see CanVec8), else
// fn(VecTag<1>).
template <typename Fn>
int SwitchVec8(bool vec, Fn&& fn) {
  return vec ? std::forward<Fn>(fn)(VecTag<8>{}) : std::forward<Fn>(fn)(VecTag<1>{});
}

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_TYPE_SWITCH_CUH_
