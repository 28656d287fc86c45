// A small reader and writer of NumPy .npy files (format versions 1.0, 2.0 and 3.0) for moectl's
// --input / --output / --d_out files.
//
//   ASSIGN_OR_RETURN(moe::Tensor x, moe::client::ReadNpy("x.npy"));   // '<f4' -> FP32
//   RETURN_IF_ERROR(moe::client::WriteNpy("out.npy", out));            // BF16 -> '<f4'
//
// Supported element types: '<f4' (FP32), '<f8' (FP64), '<i4' (INT32), '<i8' (INT64), C order
// only ('|' and '=' byte orders are accepted where they mean little-endian on this machine).
// bfloat16: NumPy has no bf16 dtype, so a BF16 tensor is written as '<f4' (exact: every bf16
// value is an fp32 value) and a file is always read in the dtype it was stored in; callers
// that want bf16 convert with Tensor::ConvertTo(DType::kBFloat16) (round to nearest even).
#ifndef MOED_CLIENT_NPY_H_
#define MOED_CLIENT_NPY_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/tensor.h"

namespace moe {
namespace client {

// Parses the bytes of a whole .npy file. INVALID_ARGUMENT names what is wrong (magic, header,
// dtype, fortran order, truncated data).
absl::StatusOr<Tensor> ParseNpy(absl::string_view contents);
// The bytes of a version 1.0 .npy file holding `tensor` (BF16 widened to '<f4').
std::string SerializeNpy(const Tensor& tensor);

// File wrappers: NOT_FOUND when the file cannot be opened for reading, INTERNAL on write errors.
absl::StatusOr<Tensor> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const Tensor& tensor);

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_NPY_H_
