#include "engine/fp8_gemms.h"

#include <algorithm>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace moe {

const char* Fp8GemmName(Fp8Gemm g) {
  switch (g) {
    case Fp8Gemm::kFc1Fprop: return "fc1_fprop";
    case Fp8Gemm::kFc1Dgrad: return "fc1_dgrad";
    case Fp8Gemm::kFc1Wgrad: return "fc1_wgrad";
    case Fp8Gemm::kFc2Fprop: return "fc2_fprop";
    case Fp8Gemm::kFc2Dgrad: return "fc2_dgrad";
    case Fp8Gemm::kFc2Wgrad: return "fc2_wgrad";
  }
  return "?";
}

std::string Fp8GemmSetName(Fp8GemmSet set) {
  std::vector<const char*> names;
  for (int i = 0; i < kFp8GemmCount; ++i) {
    if (Fp8GemmIn(set, static_cast<Fp8Gemm>(i))) names.push_back(Fp8GemmName(static_cast<Fp8Gemm>(i)));
  }
  return names.empty() ? "none" : absl::StrJoin(names, ",");
}

std::string Fp8GemmsPolicyName(const Fp8GemmsPolicy& p) {
  switch (p.kind) {
    case Fp8GemmsPolicy::Kind::kAuto: return "AUTO";
    case Fp8GemmsPolicy::Kind::kAll: return "ALL";
    case Fp8GemmsPolicy::Kind::kSet: return Fp8GemmSetName(p.set);
  }
  return "?";
}

absl::StatusOr<Fp8GemmsPolicy> ParseFp8GemmsPolicy(absl::string_view text) {
  Fp8GemmsPolicy p;
  if (text == "AUTO") return p;
  if (text == "ALL") {
    p.kind = Fp8GemmsPolicy::Kind::kAll;
    return p;
  }
  p.kind = Fp8GemmsPolicy::Kind::kSet;
  if (text == "none") return p;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    bool found = false;
    for (int i = 0; i < kFp8GemmCount && !found; ++i) {
      const Fp8Gemm g = static_cast<Fp8Gemm>(i);
      if (item != Fp8GemmName(g)) continue;
      if (Fp8GemmIn(p.set, g)) {
        return absl::InvalidArgumentError(absl::StrCat("fp8_gemms: '", item, "' given twice"));
      }
      p.set |= Fp8GemmBit(g);
      found = true;
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fp8_gemms: '", item,
          "' is not AUTO, ALL, none or a list of fc1_fprop, fc1_dgrad, fc1_wgrad, fc2_fprop, "
          "fc2_dgrad, fc2_wgrad"));
    }
  }
  return p;
}

bool CpuFp8GemmPays(const Fp8GemmShape& s) {
  const bool fc1 = s.gemm == Fp8Gemm::kFc1Fprop || s.gemm == Fp8Gemm::kFc1Dgrad ||
                   s.gemm == Fp8Gemm::kFc1Wgrad;
  const int64_t narrow = fc1 ? std::min(s.hidden, s.up) : std::min(s.ffn, s.hidden);
  return narrow >= kCpuFp8MinWidth;
}

}  // namespace moe
