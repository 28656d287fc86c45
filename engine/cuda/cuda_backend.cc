// CudaBackend: device, streams, the memory pool, copies and GEMMs.
#include "engine/cuda/cuda_backend.h"

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cublaslt_plans.h"
#include "engine/cuda/cuda_backend_impl.h"
#include "engine/cuda/fp8_gemm_table.h"
#include "engine/cuda/cuda_status.h"
#include "engine/fp8.h"
#include "engine/status_macros.h"

namespace moe {

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return count;
}

int64_t CudaDeviceMemoryBytes(int device) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return static_cast<int64_t>(prop.totalGlobalMem);
}

absl::Status PinHostMemory(void* host, size_t bytes) {
  if (host == nullptr || bytes == 0) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaHostRegister(host, bytes, cudaHostRegisterPortable));
  return absl::OkStatus();
}

absl::Status UnpinHostMemory(void* host) {
  if (host == nullptr) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaHostUnregister(host));
  return absl::OkStatus();
}

namespace {

// The driver's cuMemGetAddressRange (base and size of the allocation holding a pointer), looked
// up at run time: the runtime API has no equivalent and the build links only cudart.
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

GetAddressRangeFn AddressRangeFunction() {
  static const GetAddressRangeFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<GetAddressRangeFn>(nullptr);
    }
    return reinterpret_cast<GetAddressRangeFn>(f);
  }();
  return fn;
}

// FAILED_PRECONDITION unless [p, p + bytes) lies inside one allocation that starts at p.
absl::Status CheckAllocationCovers(void* p, size_t bytes) {
  GetAddressRangeFn range = AddressRangeFunction();
  if (range == nullptr) {
    return absl::FailedPreconditionError(
        "cannot check the size of a CUDA IPC allocation (no cuMemGetAddressRange in this "
        "driver)");
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
    return absl::FailedPreconditionError("cuMemGetAddressRange failed on a CUDA IPC allocation");
  }
  if (base != reinterpret_cast<CUdeviceptr>(p) || size < bytes) {
    return absl::FailedPreconditionError(absl::StrCat("the CUDA allocation shared by IPC holds ",
                                                      size, " bytes, fewer than the ", bytes,
                                                      " registered"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<void*> OpenCudaIpcHandle(absl::string_view handle, int device, size_t bytes) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a CUDA IPC handle has ", sizeof(cudaIpcMemHandle_t), " bytes, not ", handle.size()));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void* p = nullptr;
  cudaError_t opened = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (opened != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cudaIpcOpenMemHandle: ", cudaGetErrorString(opened),
                     " (the allocation must be live in a process on this host, and not opened "
                     "by the process that made it)"));
  }
  // The region must lie inside the allocation the handle shares: a client that declares more
  // bytes than it shared would otherwise have the worker read and write past it, into
  // whatever else is mapped there.
  absl::Status covered = CheckAllocationCovers(p, bytes);
  if (!covered.ok()) {
    cudaIpcCloseMemHandle(p);
    return covered;
  }
  return p;
}

absl::Status CloseCudaIpcHandle(void* device_ptr) {
  if (device_ptr == nullptr) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaIpcCloseMemHandle(device_ptr));
  return absl::OkStatus();
}

absl::StatusOr<void*> AllocateSharableDeviceMemory(int device, size_t bytes) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void* p = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));  // cudaMalloc memory can be shared by IPC
  return p;
}

absl::Status FreeDeviceMemory(void* device_ptr) {
  if (device_ptr != nullptr) CUDA_RETURN_IF_ERROR(cudaFree(device_ptr));
  return absl::OkStatus();
}

absl::StatusOr<std::string> CudaIpcHandleOf(void* device_ptr) {
  cudaIpcMemHandle_t h;
  CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, device_ptr));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

absl::Status CopyMemory(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device,
                                                         const CudaBackendOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaBackend> backend,
                   cuda::CudaBackend::Create(device, options));
  return std::unique_ptr<Backend>(std::move(backend));
}

namespace cuda {
namespace {

// A kernel launcher's result (0 or a cudaError_t) as a status, for code that must free its
// scratch on every way out (no early return).
absl::Status Launched(int err, const char* what) {
  return err == 0 ? absl::OkStatus() : CudaStatus(err, what, __FILE__, __LINE__);
}

}  // namespace

CublasLtGemm::Tuning GemmTuningOf(const CudaBackendOptions& options) {
  CublasLtGemm::Tuning tuning;
  tuning.wgrad_algo_index = options.cublaslt_wgrad_algo;
  tuning.wgrad_accumulate_algo_index = options.cublaslt_wgrad_accum_algo >= 0
                                           ? options.cublaslt_wgrad_accum_algo
                                           : options.cublaslt_wgrad_algo;
  tuning.log_plans = options.cublaslt_log;
  tuning.tuned_plans = options.cublaslt_tuned;
  return tuning;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    int device, const CudaBackendOptions& options) {
  RETURN_IF_ERROR(CheckCudaBackendOptions(options));
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " requested but ", count, " visible"));
  }
  std::unique_ptr<CudaBackend> backend(new CudaBackend(device));
  RETURN_IF_ERROR(backend->Init(options));
  return backend;
}

absl::Status CudaBackend::Init(const CudaBackendOptions& options) {
  RETURN_IF_ERROR(Activate());
  use_staging_ = options.host_staging;
  workspace_bytes_ = static_cast<size_t>(options.cublaslt_workspace_mb) << 20;
  CublasLtGemm::Tuning tuning = GemmTuningOf(options);
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
  tuning.tuned_plans =
      tuning.tuned_plans &&
      TunedGemmsApply(prop.major, prop.minor, prop.multiProcessorCount, cublasLtGetVersion());
  fp8_gemm_table_ = Fp8GemmTableApplies(prop.major, prop.minor, prop.multiProcessorCount,
                                        cublasLtGetVersion());
  serial_gemm_flops_ = static_cast<double>(options.gemm_serial_gflops) * 1e9;
  side_stream_count_ = options.gemm_streams;
  split_fp32_gemm_ = options.fp32_gemm_bf16x3;
  // Keep freed pool memory for reuse: steps allocate and free the same sizes every time.
  cudaMemPool_t pool;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device_));
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  cudaStream_t s;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
  for (int i = 0; i < side_stream_count_; ++i) {
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    side_streams_[i] = s;
  }
  for (int i = 0; i <= kMaxSideStreams; ++i) {
    if (i < side_stream_count_ || i == kMaxSideStreams) {
      cudaEvent_t e;
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      side_events_[i] = e;
    }
    if (i <= side_stream_count_) {
      CUDA_RETURN_IF_ERROR(cudaMalloc(&workspace_[i], workspace_bytes_));
    }
  }
  ASSIGN_OR_RETURN(gemm_, CublasLtGemm::Create(tuning));
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  gemm_.reset();
  for (int i = 0; i <= kMaxSideStreams; ++i) {
    if (workspace_[i] != nullptr) cudaFree(workspace_[i]);
    if (side_events_[i] != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(side_events_[i]));
  }
  for (void* s : side_streams_) {
    if (s != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(s));
  }
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  // Hand this backend's pooled memory back (its buffers are all freed by now).
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device_) == cudaSuccess) {
    cudaDeviceSynchronize();
    cudaMemPoolTrimTo(pool, 0);
  }
}

absl::Status CudaBackend::Activate() const {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return absl::OkStatus();
}

absl::StatusOr<Buffer> CudaBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer();
  RETURN_IF_ERROR(Activate());
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream_));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cudaMallocAsync of ", bytes, " bytes on ",
                                                     name(), ": ", cudaGetErrorString(err)));
  }
  {
    absl::MutexLock lock(&mu_);
    live_[p] = bytes;
    allocated_ += bytes;
    peak_ = std::max(peak_, allocated_);
  }
  return Buffer(p, bytes, [this](void* q) { Release(q); });
}

void CudaBackend::Release(void* p) {
  {
    absl::MutexLock lock(&mu_);
    auto it = live_.find(p);
    if (it != live_.end()) {
      allocated_ -= it->second;
      live_.erase(it);
    }
  }
  cudaSetDevice(device_);
  cudaFreeAsync(p, static_cast<cudaStream_t>(stream_));  // stream-ordered: after queued work
}

size_t CudaBackend::allocated_bytes() const {
  absl::MutexLock lock(&mu_);
  return allocated_;
}

size_t CudaBackend::peak_allocated_bytes() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

absl::StatusOr<void*> CudaBackend::ScratchAlloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) return p;
  CUDA_RETURN_IF_ERROR(cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream_)));
  return p;
}

absl::Status CudaBackend::ScratchFree(void* p) {
  if (p != nullptr) CUDA_RETURN_IF_ERROR(cudaFreeAsync(p, static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyFromHost(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || host_src == nullptr) {
    return absl::InvalidArgumentError("CopyFromHost: null pointer");
  }
  RETURN_IF_ERROR(Activate());
  if (use_staging_ && bytes >= HostStaging::kMinBytes && !HostStaging::CopiesDirectly(host_src)) {
    return staging_.ToDevice(dst, host_src, bytes, stream_);
  }
  // cudaMemcpyDefault: `host_src` may also be device memory (a client's CUDA IPC region).
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  RETURN_IF_ERROR(Activate());
  if (bytes > 0) {
    if (host_dst == nullptr || src == nullptr) {
      return absl::InvalidArgumentError("CopyToHost: null pointer");
    }
    if (use_staging_ && bytes >= HostStaging::kMinBytes && !HostStaging::CopiesDirectly(host_dst)) {
      return staging_.ToHost(host_dst, src, bytes, stream_);  // waits for the stream's work
    }
    // cudaMemcpyDefault: `host_dst` may also be device memory (a client's CUDA IPC region).
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDefault,
                                         static_cast<cudaStream_t>(stream_)));
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("Copy: null pointer");
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                       static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Memset(void* dst, int value, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("Memset: null pointer");
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Synchronize() {
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status CudaBackend::CheckGemm(const GemmArgs& g) const {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: ", what));
  };
  if (g.m < 0 || g.n < 0 || g.k < 0) return bad("negative dimension");
  if (g.is_fp8() || g.b_fp8 != DType::kFloat32) {
    if (!IsFp8(g.a_fp8) || !IsFp8(g.b_fp8)) return bad("a_fp8 and b_fp8 must both be FP8 types");
    if (g.a_fp8 == DType::kFloat8E5M2 && g.b_fp8 == DType::kFloat8E5M2) {
      return bad("FP8 operands cannot both be E5M2");
    }
    if (g.trans_a || !g.trans_b) return bad("FP8 operands need trans_a = false, trans_b = true");
    if (g.a_scale == nullptr || g.b_scale == nullptr) return bad("FP8 operands need scales");
    if (reinterpret_cast<uintptr_t>(g.a_scale) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(g.b_scale) % 16 != 0) {
      return bad("FP8 scales must be 16-byte aligned (cuBLASLt refuses others)");
    }
  } else if (!IsKernelType(g.ab_type)) {
    return bad("ab_type");
  }
  if (!IsKernelType(g.c_type)) return bad("c_type");
  if (g.a_bf16 != nullptr &&
      (g.is_fp8() || g.ab_type != DType::kFloat32 || g.c_type != DType::kFloat32)) {
    return bad("a_bf16 is for fp32 operands and an fp32 C only");
  }
  if (g.m == 0 || g.n == 0) return absl::OkStatus();
  if (g.c == nullptr || g.ldc < g.n) return bad("c is null or ldc < n");
  if (g.k == 0) return absl::OkStatus();
  if ((g.a == nullptr && (g.a_bf16 == nullptr || !split_fp32_gemm_)) || g.b == nullptr) {
    return bad("a or b is null");
  }
  if (g.lda < (g.trans_a ? g.m : g.k)) return bad("lda too small");
  if (g.ldb < (g.trans_b ? g.k : g.n)) return bad("ldb too small");
  return absl::OkStatus();
}

absl::Status CudaBackend::RunGemm(const GemmArgs& g, void* stream, void* workspace) {
  if (g.m == 0 || g.n == 0) return absl::OkStatus();
  if (g.k == 0) {  // C = beta * C
    if (g.beta == 1.0f) return absl::OkStatus();
    CUDA_RETURN_IF_ERROR(LaunchScale(g.c, ToKType(g.c_type), g.beta, g.m, g.n, g.ldc, stream));
    return absl::OkStatus();
  }
  return gemm_->Run(g, stream, workspace, workspace_bytes_);
}

absl::Status CudaBackend::Gemm(const GemmArgs& args) {
  RETURN_IF_ERROR(CheckGemm(args));
  RETURN_IF_ERROR(Activate());
  if (split_fp32_gemm_ && args.m > 0 && args.n > 0 && args.k > 0 && !args.is_fp8() &&
      args.ab_type == DType::kFloat32 && args.c_type == DType::kFloat32) {
    if (args.a_bf16 != nullptr) {
      if (args.n <= kMaxSplitGemmN) return SplitFp32Gemm(args);
      if (args.a == nullptr) return WidenedAGemm(args);
    } else if (args.k >= kMinShortKGemmK && args.k <= kMaxShortKGemmK &&
               12.0 * args.k * (args.m + args.n) <= 4.0 * args.m * args.n) {
      return ShortKFp32Gemm(args);
    }
  }
  return RunGemm(args, stream_, workspace_[0]);
}

// The fp32 GEMM of two fp32 operands with a short k (the router's d_x += d_z . gate^T, k = E)
// on bf16 tensor cores: both split into bf16 parts (bf16_split.h) and the six part products
// down to 2^-22 of |a||b| (hi.hi, hi.mid, mid.hi, hi.lo, mid.mid, lo.hi; the three left out
// are below 2^-22, under the tensor cores' own accumulation error) laid along k, so that one
// bf16 GEMM with k' = 6k sums them all in its fp32 accumulator, straight into C with alpha and
// beta. The parts cost 12 k (m + n) bytes of scratch, at most C's own size (Gemm's rule). On
// the H200 it beat the fp32 GEMM at k = 128 (qwen3's d_x) and 256 (dsv3's: 1.4 ms less) but
// lost at k = 8 (te_seed, mixtral: +0.04 ms), hence k >= kMinShortKGemmK (docs/PERFORMANCE.md).
absl::Status CudaBackend::ShortKFp32Gemm(const GemmArgs& g) {
  constexpr int kTerms = 6;
  Bf16PartList a_parts, b_parts;
  a_parts.count = b_parts.count = kTerms;
  const int a_seq[kTerms] = {0, 0, 1, 0, 1, 2}, b_seq[kTerms] = {0, 1, 0, 2, 1, 0};
  for (int s = 0; s < kTerms; ++s) a_parts.part[s] = a_seq[s], b_parts.part[s] = b_seq[s];
  ASSIGN_OR_RETURN(void* a6, ScratchAlloc(kTerms * g.m * g.k * sizeof(uint16_t)));
  absl::StatusOr<void*> b6 = ScratchAlloc(kTerms * g.k * g.n * sizeof(uint16_t));
  absl::Status status = b6.status();
  // Along k: A [m, k] gets its blocks beside each other, A stored [k, m] (trans_a) under each
  // other; B [k, n] under each other, B stored [n, k] (trans_b) beside each other.
  if (status.ok()) {
    status = Launched(LaunchSplitBf16Parts(static_cast<const float*>(g.a), g.trans_a ? g.k : g.m,
                                           g.trans_a ? g.m : g.k, g.lda, a_parts,
                                           /*stack_rows=*/g.trans_a, a6, stream_),
                      "LaunchSplitBf16Parts");
  }
  if (status.ok()) {
    status = Launched(LaunchSplitBf16Parts(static_cast<const float*>(g.b), g.trans_b ? g.n : g.k,
                                           g.trans_b ? g.k : g.n, g.ldb, b_parts,
                                           /*stack_rows=*/!g.trans_b, *b6, stream_),
                      "LaunchSplitBf16Parts");
  }
  if (status.ok()) {
    GemmArgs bf = g;
    bf.ab_type = DType::kBFloat16;
    bf.k = kTerms * g.k;
    bf.a = a6;
    bf.lda = g.trans_a ? g.m : kTerms * g.k;
    bf.b = *b6;
    bf.ldb = g.trans_b ? kTerms * g.k : g.n;
    status = RunGemm(bf, stream_, workspace_[0]);
  }
  if (b6.ok()) status.Update(ScratchFree(*b6));
  status.Update(ScratchFree(a6));
  return status;
}

// The fp32 GEMM of a caller that gave A only as bf16 (GemmReadsBf16A), for shapes SplitFp32Gemm
// does not take: A widened to fp32 in scratch, then cuBLASLt's fp32 GEMM.
absl::Status CudaBackend::WidenedAGemm(const GemmArgs& g) {
  const int64_t rows = g.trans_a ? g.k : g.m, cols = g.trans_a ? g.m : g.k;
  const int64_t span = (rows - 1) * g.lda + cols;
  ASSIGN_OR_RETURN(void* a32, ScratchAlloc(span * sizeof(float)));
  absl::Status status = Launched(
      LaunchConvert(g.a_bf16, KType::kBF16, a32, KType::kF32, span, stream_), "LaunchConvert");
  if (status.ok()) {
    GemmArgs wide = g;
    wide.a = a32;
    wide.a_bf16 = nullptr;
    status = RunGemm(wide, stream_, workspace_[0]);
  }
  status.Update(ScratchFree(a32));
  return status;
}

// The fp32 GEMM C = alpha A.B + beta C whose A is exactly bf16 (GemmArgs::a_bf16), on bf16
// tensor cores: B = B_hi + B_mid + B_lo exactly (bf16_split.h), so one bf16 GEMM
// A . [B_hi | B_mid | B_lo] (fp32 accumulation) gives the three exact-product sums side by
// side, added smallest first. The router's logits and d_gate (n = E) read x once, and the
// tensor cores do 3x the fp32 GEMM's work several times faster than fp32 FMA units.
absl::Status CudaBackend::SplitFp32Gemm(const GemmArgs& g) {
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  ASSIGN_OR_RETURN(void* parts, ScratchAlloc(3 * g.k * g.n * sizeof(uint16_t)));
  absl::StatusOr<void*> sums = ScratchAlloc(3 * g.m * g.n * sizeof(float));
  absl::Status status = sums.status();
  if (status.ok()) {
    Bf16PartList all;
    all.count = 3, all.part[0] = 0, all.part[1] = 1, all.part[2] = 2;
    status = Launched(LaunchSplitBf16Parts(static_cast<const float*>(g.b), b_rows, b_cols, g.ldb,
                                           all, /*stack_rows=*/g.trans_b, parts, stream_),
                      "LaunchSplitBf16Parts");
  }
  if (status.ok()) {
    GemmArgs bf = g;
    bf.a = g.a_bf16;
    bf.a_bf16 = nullptr;
    bf.ab_type = DType::kBFloat16;
    bf.b = parts;
    bf.ldb = g.trans_b ? g.k : 3 * g.n;
    bf.n = 3 * g.n;
    bf.c = *sums;
    bf.ldc = 3 * g.n;
    bf.alpha = 1.0f;
    bf.beta = 0.0f;
    status = RunGemm(bf, stream_, workspace_[0]);
  }
  if (status.ok()) {
    status = Launched(LaunchSumBf16x3Planes(static_cast<const float*>(*sums), g.m, g.n, g.alpha,
                                            g.beta, static_cast<float*>(g.c), g.ldc, stream_),
                      "LaunchSumBf16x3Planes");
  }
  if (sums.ok()) status.Update(ScratchFree(*sums));
  status.Update(ScratchFree(parts));
  return status;
}

absl::Status CudaBackend::GroupedGemm(absl::Span<const GemmArgs> gemms) {
  double flops = 0;
  int nonempty = 0;
  for (const GemmArgs& g : gemms) {
    RETURN_IF_ERROR(CheckGemm(g));
    if (g.a_bf16 != nullptr) return absl::InvalidArgumentError("GroupedGemm: a_bf16 is for Gemm");
    if (g.m > 0 && g.n > 0 && g.k > 0) {
      flops += 2.0 * g.m * g.n * g.k;
      ++nonempty;
    }
  }
  RETURN_IF_ERROR(Activate());
  // The GEMMs overlap on the side streams: small ones fill the GPU together, and a large one's
  // last wave runs beside the next one's first (2-3 % of te_seed's and mixtral's steps on the
  // H200 against one at a time, docs/PERFORMANCE.md). Each GEMM's plan, and so its result, is
  // the same on any stream.
  if (nonempty <= 1 || (serial_gemm_flops_ > 0 && flops / nonempty > serial_gemm_flops_)) {
    for (const GemmArgs& g : gemms) RETURN_IF_ERROR(RunGemm(g, stream_, workspace_[0]));
    return absl::OkStatus();
  }
  const cudaStream_t main = static_cast<cudaStream_t>(stream_);
  cudaEvent_t fork = static_cast<cudaEvent_t>(side_events_[kMaxSideStreams]);
  CUDA_RETURN_IF_ERROR(cudaEventRecord(fork, main));
  const int used = std::min(side_stream_count_, nonempty);
  for (int i = 0; i < used; ++i) {
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(static_cast<cudaStream_t>(side_streams_[i]), fork, 0));
  }
  int next = 0;
  absl::Status status;
  for (const GemmArgs& g : gemms) {
    if (g.m == 0 || g.n == 0) continue;
    if (g.k == 0) {
      status = RunGemm(g, stream_, workspace_[0]);  // ordered before the join on main
    } else {
      const int i = next++ % used;
      status = RunGemm(g, side_streams_[i], workspace_[i + 1]);
    }
    if (!status.ok()) break;
  }
  // Join even after an error, so that the main stream never runs ahead of side work.
  for (int i = 0; i < used; ++i) {
    cudaEvent_t done = static_cast<cudaEvent_t>(side_events_[i]);
    CUDA_RETURN_IF_ERROR(cudaEventRecord(done, static_cast<cudaStream_t>(side_streams_[i])));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main, done, 0));
  }
  return status;
}

absl::Status CudaBackend::Convert(const void* src, DType src_type, void* dst, DType dst_type,
                                  int64_t count) {
  if (count < 0) return absl::InvalidArgumentError("Convert: negative count");
  if (count == 0) return absl::OkStatus();
  if (src == nullptr || dst == nullptr) return absl::InvalidArgumentError("Convert: null pointer");
  RETURN_IF_ERROR(Activate());
  if (src_type == dst_type) return Copy(dst, src, count * DTypeSize(src_type));
  if (!IsKernelType(src_type) || !IsKernelType(dst_type)) {
    return absl::InvalidArgumentError(absl::StrCat("Convert: ", DTypeName(src_type), " -> ",
                                                   DTypeName(dst_type), " unsupported"));
  }
  CUDA_RETURN_IF_ERROR(
      LaunchConvert(src, ToKType(src_type), dst, ToKType(dst_type), count, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::AddInPlace(float* dst, const float* src, int64_t count) {
  if (count < 0) return absl::InvalidArgumentError("AddInPlace: negative count");
  if (count == 0) return absl::OkStatus();
  if (src == nullptr || dst == nullptr) {
    return absl::InvalidArgumentError("AddInPlace: null pointer");
  }
  RETURN_IF_ERROR(Activate());
  CUDA_RETURN_IF_ERROR(LaunchAddInPlace(dst, src, count, stream_));
  return absl::OkStatus();
}

std::vector<GroupTable> MakeGroupTables(GroupRows group_rows) {
  std::vector<GroupTable> tables;
  int64_t row = 0;
  for (size_t g = 0; g < group_rows.size(); g += kMaxTableGroups) {
    GroupTable t;
    t.first_group = static_cast<int64_t>(g);
    t.count = static_cast<int>(std::min<size_t>(kMaxTableGroups, group_rows.size() - g));
    for (int i = 0; i < t.count; ++i) {
      t.start[i] = row;
      row += group_rows[g + i];
    }
    t.start[t.count] = row;
    tables.push_back(t);
  }
  return tables;
}

}  // namespace cuda
}  // namespace moe
