#include "engine/dtype.h"

#include "absl/strings/str_cat.h"

namespace moe {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "FP32";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat64:
      return "FP64";
    case DType::kInt32:
      return "INT32";
    case DType::kInt64:
      return "INT64";
    case DType::kFloat8E4M3:
      return "FP8_E4M3";
    case DType::kFloat8E5M2:
      return "FP8_E5M2";
  }
  return "UNKNOWN";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat64, DType::kInt32,
                  DType::kInt64}) {
    if (name == DTypeName(d)) return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("datatype: unknown datatype '", name, "' (FP32, BF16, FP64, INT32, INT64)"));
}

}  // namespace moe
