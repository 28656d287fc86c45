#include "client/step_stream.h"

#include <cstdint>

namespace moe {
namespace client {

size_t DeclaredTensorBytes(const v1::Tensor& tensor) {
  absl::StatusOr<DType> dtype = ParseDType(tensor.datatype());
  if (!dtype.ok()) return 0;
  int64_t bytes = static_cast<int64_t>(DTypeSize(*dtype));
  for (int64_t d : tensor.shape()) {
    if (d < 0 || (d > 0 && bytes > INT64_MAX / d)) return 0;
    bytes *= d;
  }
  return static_cast<size_t>(bytes);
}

}  // namespace client
}  // namespace moe
