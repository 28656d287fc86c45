// Private: the CudaBackend class behind MakeCudaBackend (engine/cuda/cuda_backend.h).
// cuda_backend.cc holds memory, copies and GEMMs; cuda_backend_ops.cc the kernel entry points.
// State below is touched from one thread at a time (the Backend contract: the layer serialises
// calls), except the allocation table, which buffer deleters may reach from any thread.
#ifndef MOED_ENGINE_CUDA_CUDA_BACKEND_IMPL_H_
#define MOED_ENGINE_CUDA_CUDA_BACKEND_IMPL_H_

#include <cstddef>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "engine/backend.h"
#include "engine/cuda/cublaslt_gemm.h"
#include "engine/cuda/cuda_backend_options.h"
#include "engine/cuda/host_staging.h"
#include "engine/cuda/kernels.cuh"

namespace moe {
namespace cuda {

// The dtypes the kernels take (KType). Entry points refuse others with INVALID_ARGUMENT before
// any launch, so ToKType only ever sees these; the launchers' type switches (type_switch.cuh)
// turn the KType into a template argument.
inline bool IsKernelType(DType t) { return t == DType::kFloat32 || t == DType::kBFloat16; }
inline KType ToKType(DType t) { return t == DType::kBFloat16 ? KType::kBF16 : KType::kF32; }

class CudaBackend : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device,
                                                             const CudaBackendOptions& options);
  ~CudaBackend() override;

  std::string name() const override { return "cuda:" + std::to_string(device_); }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }
  void* stream() const override { return stream_; }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override;
  absl::Status CopyFromHost(void* dst, const void* host_src, size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  absl::Status Copy(void* dst, const void* src, size_t bytes) override;
  absl::Status Memset(void* dst, int value, size_t bytes) override;
  absl::Status Synchronize() override;
  size_t allocated_bytes() const override;
  size_t peak_allocated_bytes() const override;

  // FP8 (cuda_backend_fp8.cc): compute capability >= 8.9, H and F multiples of 16.
  absl::Status CheckComputeDType(const LayerConfig& config) const override;
  // fp8_gemms = AUTO: engine/cuda/fp8_gemm_table.h where it applies, else FP8.
  bool Fp8GemmPays(const Fp8GemmShape& shape) const override;
  absl::Status QuantizeFp8(const QuantizeArgs& args) override;
  absl::Status Fp8HistoryAmax(const Fp8HistoryArgs& args) override;

  absl::Status Gemm(const GemmArgs& args) override;
  bool GemmReadsBf16A() const override { return split_fp32_gemm_; }
  absl::Status GroupedGemm(absl::Span<const GemmArgs> gemms) override;
  absl::Status Convert(const void* src, DType src_type, void* dst, DType dst_type,
                       int64_t count) override;
  absl::Status AddInPlace(float* dst, const float* src, int64_t count) override;

  absl::Status RouterForward(const RouterForwardArgs& args) override;
  absl::Status RouterBackward(const RouterBackwardArgs& args) override;
  absl::Status RoutePlan(const RoutePlanArgs& args) override;
  absl::Status Permute(const PermuteArgs& args) override;
  absl::Status GatherRows(const void* src, const int32_t* index, int64_t rows, int64_t width,
                          DType dtype, void* dst) override;
  absl::Status ScatterTokenRows(const void* src, const int32_t* pair_row, int64_t tokens,
                                int64_t top_k, const int32_t* row_token, int64_t rows,
                                int64_t width, DType dtype, void* dst) override;
  absl::Status CopyRowBlocks(const void* src, void* dst, size_t row_bytes,
                             absl::Span<const RowBlock> blocks) override;
  absl::Status CombineRows(const void* y, DType y_type, const int32_t* pair_row,
                           const float* weight, int64_t tokens, int64_t top_k, int64_t width,
                           void* out, DType out_type) override;
  absl::Status CombineBackward(const void* d_out, DType d_out_type, const void* y, DType y_type,
                               const int32_t* pair_row, const float* weight, int64_t tokens,
                               int64_t top_k, int64_t width, int64_t total_rows, void* d_y,
                               float* d_weight) override;
  absl::Status ActivationForward(const ActivationArgs& args) override;
  absl::Status ActivationBackward(const ActivationArgs& args) override;
  absl::Status AddGroupBias(void* y, DType dtype, const float* bias, int64_t width,
                            GroupRows group_rows) override;
  absl::Status GroupBiasGrad(const void* d_y, DType dtype, int64_t width, GroupRows group_rows,
                             float* d_bias) override;
  absl::Status OptimizerStep(const OptimizerArgs& args, float* param, const float* grad,
                             float* state1, float* state2, int64_t count) override;

 private:
  // GroupedGemm's side streams: CudaBackendOptions::gemm_streams of them, at most
  // kMaxSideStreams.
  static constexpr int kMaxSideStreams = CudaBackendOptions::kMaxGemmStreams;
  static constexpr int kDefaultSideStreams = CudaBackendOptions().gemm_streams;
  static constexpr size_t kDefaultWorkspaceBytes =
      static_cast<size_t>(CudaBackendOptions().cublaslt_workspace_mb) << 20;
  // GroupedGemm overlaps GEMMs on the side streams unless their mean size is above this
  // (0: no limit).
  static constexpr int64_t kDefaultSerialGemmGflops = CudaBackendOptions().gemm_serial_gflops;

  explicit CudaBackend(int device) : device_(device) {}
  absl::Status Init(const CudaBackendOptions& options);
  absl::Status Activate() const;  // cudaSetDevice(device_)
  // Stream-ordered scratch for one call (freed on the stream after its kernels).
  absl::StatusOr<void*> ScratchAlloc(size_t bytes);
  absl::Status ScratchFree(void* p);
  absl::Status RunGemm(const GemmArgs& args, void* stream, void* workspace);
  // Gemm of fp32 operands whose A is given as bf16 too (GemmArgs::a_bf16), on bf16 tensor
  // cores (cuda_backend.cc). For n <= kMaxSplitGemmN: its scratch holds 3 m n floats.
  absl::Status SplitFp32Gemm(const GemmArgs& args);
  absl::Status WidenedAGemm(const GemmArgs& args);  // a null, a_bf16 given, n too large
  // Gemm of fp32 operands with kMinShortKGemmK <= k <= kMaxShortKGemmK whose bf16 parts take
  // no more scratch than C (cuda_backend.cc): on bf16 tensor cores, six part products along k.
  absl::Status ShortKFp32Gemm(const GemmArgs& args);
  static constexpr int64_t kMinShortKGemmK = 128;
  static constexpr int64_t kMaxShortKGemmK = 1024;
  static constexpr int64_t kMaxSplitGemmN = 4096;
  absl::Status CheckGemm(const GemmArgs& args) const;
  // QuantizeFp8 with dst_grouped_t (cuda_backend_fp8.cc), after the common checks.
  absl::Status QuantizeFp8Grouped(const QuantizeArgs& args);
  void Release(void* p);

  int device_;
  void* stream_ = nullptr;                       // cudaStream_t
  int side_stream_count_ = kDefaultSideStreams;  // options.gemm_streams
  void* side_streams_[kMaxSideStreams] = {};     // cudaStream_t; the first side_stream_count_
  void* side_events_[kMaxSideStreams + 1] = {};  // cudaEvent_t; [kMaxSideStreams] is the fork
  void* workspace_[kMaxSideStreams + 1] = {};    // cuBLASLt workspaces; [0] main stream
  std::unique_ptr<CublasLtGemm> gemm_;
  HostStaging staging_;       // large copies to/from pageable host memory
  bool use_staging_ = false;  // options.host_staging
  // Each cuBLASLt workspace's size: options.cublaslt_workspace_mb.
  size_t workspace_bytes_ = kDefaultWorkspaceBytes;
  // GroupedGemm's threshold in FLOP, 0 for none: options.gemm_serial_gflops.
  double serial_gemm_flops_ = kDefaultSerialGemmGflops * 1e9;
  // fp32 Gemms on bf16 tensor cores (SplitFp32Gemm, ShortKFp32Gemm): options.fp32_gemm_bf16x3.
  bool split_fp32_gemm_ = true;
  // Fp8GemmTableApplies on this device (Init).
  bool fp8_gemm_table_ = false;

  mutable absl::Mutex mu_;
  std::unordered_map<void*, size_t> live_ ABSL_GUARDED_BY(mu_);
  size_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
  size_t peak_ ABSL_GUARDED_BY(mu_) = 0;
};

// The cuBLASLt knobs of `options` (tuned_plans before the device check of TunedGemmsApply).
CublasLtGemm::Tuning GemmTuningOf(const CudaBackendOptions& options);

// Splits host row counts into kernel tables of at most kMaxTableGroups groups each.
std::vector<GroupTable> MakeGroupTables(GroupRows group_rows);

}  // namespace cuda
}  // namespace moe

#endif  // MOED_ENGINE_CUDA_CUDA_BACKEND_IMPL_H_
