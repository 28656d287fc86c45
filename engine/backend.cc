// Backend: the default implementations of the seam's optional operations.
#include "engine/backend.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/status_macros.h"

namespace moe {

Fp8GemmSet ResolveFp8Gemms(const LayerConfig& config, const Backend& backend) {
  if (config.compute_dtype != DType::kFloat8E4M3) return 0;
  switch (config.fp8_gemms.kind) {
    case Fp8GemmsPolicy::Kind::kAll: return kAllFp8Gemms;
    case Fp8GemmsPolicy::Kind::kSet: return config.fp8_gemms.set & kAllFp8Gemms;
    case Fp8GemmsPolicy::Kind::kAuto: break;
  }
  Fp8GemmSet set = 0;
  for (int i = 0; i < kFp8GemmCount; ++i) {
    Fp8GemmShape shape;
    shape.gemm = static_cast<Fp8Gemm>(i);
    shape.hidden = config.hidden, shape.ffn = config.ffn, shape.up = UpWidth(config);
    shape.num_experts = config.num_experts, shape.top_k = config.top_k;
    if (backend.Fp8GemmPays(shape)) set |= Fp8GemmBit(shape.gemm);
  }
  return set;
}

absl::Status Backend::AllFinite(const float* data, int64_t count, bool* all_finite) {
  // 4 MiB of host memory whatever the tensor's size.
  constexpr int64_t kPiece = int64_t{1} << 20;
  std::vector<float> host(static_cast<size_t>(std::min(count, kPiece)));
  *all_finite = true;
  for (int64_t offset = 0; offset < count; offset += kPiece) {
    const int64_t n = std::min(kPiece, count - offset);
    RETURN_IF_ERROR(CopyToHost(host.data(), data + offset, n * sizeof(float)));
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(host[i])) {
        *all_finite = false;
        return absl::OkStatus();
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
