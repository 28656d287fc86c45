// Backend: the default implementations of the seam's optional operations.
#include "engine/backend.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/status_macros.h"

namespace moe {

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
