// Which of the expert FFN's six GEMMs run on FP8 operands when compute_dtype = FP8
// (docs/SPEC.md "FP8", "Per-GEMM choice"): LayerConfig::fp8_gemms says AUTO (the backend
// decides per GEMM by measurement: engine/backend.h Backend::Fp8GemmPays), ALL, or an explicit
// set; a GEMM outside the resolved set runs in bf16 exactly as the BF16 layer runs it.
//
//   ASSIGN_OR_RETURN(Fp8GemmsPolicy p, ParseFp8GemmsPolicy("fc1_fprop,fc1_dgrad"));
//   if (Fp8GemmIn(resolved_set, Fp8Gemm::kFc2Wgrad)) ...   // this GEMM quantises
//   LOG(INFO) << Fp8GemmSetName(resolved_set);             // "fc1_fprop,fc1_dgrad" or "none"
#ifndef MOED_ENGINE_FP8_GEMMS_H_
#define MOED_ENGINE_FP8_GEMMS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

// The expert GEMMs (per local expert, docs/SPEC.md Forward 10 and Backward 3): fc1 is the up
// projection (wi [H, up]), fc2 the down projection (wo [F, H]).
//   fc1_fprop h = X_e . wi        fc2_fprop y = a . wo
//   fc2_dgrad d_a = d_y . wo^T    fc2_wgrad d_wo += a^T . d_y
//   fc1_dgrad d_X_e = d_h . wi^T  fc1_wgrad d_wi += X_e^T . d_h
enum class Fp8Gemm { kFc1Fprop = 0, kFc1Dgrad, kFc1Wgrad, kFc2Fprop, kFc2Dgrad, kFc2Wgrad };
inline constexpr int kFp8GemmCount = 6;
// A set of Fp8Gemm: bit (1 << int(gemm)).
using Fp8GemmSet = uint32_t;
inline constexpr Fp8GemmSet kAllFp8Gemms = (1u << kFp8GemmCount) - 1;
inline bool Fp8GemmIn(Fp8GemmSet set, Fp8Gemm g) { return (set >> static_cast<int>(g)) & 1u; }
inline Fp8GemmSet Fp8GemmBit(Fp8Gemm g) { return 1u << static_cast<int>(g); }

const char* Fp8GemmName(Fp8Gemm g);  // "fc1_fprop", ...
// The set as its GEMMs' names in Fp8Gemm order joined by ",", or "none" when empty.
std::string Fp8GemmSetName(Fp8GemmSet set);

// LayerConfig::fp8_gemms.
struct Fp8GemmsPolicy {
  enum class Kind { kAuto, kAll, kSet };
  Kind kind = Kind::kAuto;
  Fp8GemmSet set = 0;  // kSet only (may be empty: every GEMM in bf16)
  bool operator==(const Fp8GemmsPolicy& o) const {
    return kind == o.kind && (kind != Kind::kSet || set == o.set);
  }
  bool operator!=(const Fp8GemmsPolicy& o) const { return !(*this == o); }
};
// "AUTO", "ALL", or the set as Fp8GemmSetName writes it ("none" for the empty set).
std::string Fp8GemmsPolicyName(const Fp8GemmsPolicy& p);
// The inverse of Fp8GemmsPolicyName: AUTO, ALL, none, or GEMM names joined by "," (each at
// most once; case-sensitive). INVALID_ARGUMENT naming the bad item otherwise.
absl::StatusOr<Fp8GemmsPolicy> ParseFp8GemmsPolicy(absl::string_view text);

// The shape an AUTO choice is made at (Backend::Fp8GemmPays): the GEMM and the layer's sizes.
// The rows per expert of a step are not known when the layer is created; a backend's
// measurements say which token counts they were taken at.
struct Fp8GemmShape {
  Fp8Gemm gemm = Fp8Gemm::kFc1Fprop;
  int64_t hidden = 0, ffn = 0, up = 0;
  int64_t num_experts = 0, top_k = 0;  // the layer's E and k
};

// The deterministic AUTO rule of the CPU backend's FP8 emulation (it has no speed to measure):
// a GEMM runs FP8 when both dims of its weight (fc1: H and up, fc2: F and H) are at least
// kCpuFp8MinWidth, the CUDA tables' finding that FP8 loses at small expert widths in
// miniature, so that CI runs layers with both kinds of GEMM.
inline constexpr int64_t kCpuFp8MinWidth = 16;
bool CpuFp8GemmPays(const Fp8GemmShape& s);

}  // namespace moe

#endif  // MOED_ENGINE_FP8_GEMMS_H_
