// libFuzzer target: client/npy.cc's ParseNpy on arbitrary bytes (a .npy file moectl reads).
// A parsed tensor must hold exactly the bytes its shape and datatype declare.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "client/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<moe::Tensor> tensor =
      moe::client::ParseNpy(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (tensor.ok()) {
    // Round trip: what was parsed serialises and parses again to the same bytes.
    absl::StatusOr<moe::Tensor> again = moe::client::ParseNpy(moe::client::SerializeNpy(*tensor));
    if (!again.ok() || again->bytes() != tensor->bytes()) std::abort();
  }
  return 0;
}
