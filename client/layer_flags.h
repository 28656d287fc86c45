// The command-line flags that describe a layer (moectl create-layer, smoke, bench) and their
// translation into a moe.v1.LayerConfig. Defaults are docs/SPEC.md's tiny test layer
// (H=32, F=64, E=8, k=2, softmax, SwiGLU, fp32).
//
//   absl::ParseCommandLine(argc, argv);
//   ASSIGN_OR_RETURN(moe::v1::LayerConfig config, moe::client::LayerConfigFromFlags());
//
// Only the syntax is checked here (names of enums and dtypes); the rules of docs/SPEC.md are the
// server's to enforce, so a bad combination reaches it and comes back INVALID_ARGUMENT.
#ifndef MOED_CLIENT_LAYER_FLAGS_H_
#define MOED_CLIENT_LAYER_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "proto/moe.pb.h"

ABSL_DECLARE_FLAG(int64_t, hidden);
ABSL_DECLARE_FLAG(int64_t, ffn);
ABSL_DECLARE_FLAG(int64_t, experts);
ABSL_DECLARE_FLAG(int64_t, top_k);
ABSL_DECLARE_FLAG(std::string, score_function);
ABSL_DECLARE_FLAG(bool, pre_softmax);
ABSL_DECLARE_FLAG(int64_t, num_groups);
ABSL_DECLARE_FLAG(int64_t, group_topk);
ABSL_DECLARE_FLAG(double, scaling_factor);
ABSL_DECLARE_FLAG(bool, expert_bias);
ABSL_DECLARE_FLAG(double, aux_loss_coeff);
ABSL_DECLARE_FLAG(double, z_loss_coeff);
ABSL_DECLARE_FLAG(double, capacity_factor);
ABSL_DECLARE_FLAG(int64_t, align_size);
ABSL_DECLARE_FLAG(std::string, activation);
ABSL_DECLARE_FLAG(bool, gated);
ABSL_DECLARE_FLAG(bool, use_bias);
ABSL_DECLARE_FLAG(std::string, compute_dtype);
ABSL_DECLARE_FLAG(uint64_t, seed);

namespace moe {
namespace client {

// INVALID_ARGUMENT naming the flag for an unknown --score_function, --activation or
// --compute_dtype.
absl::StatusOr<v1::LayerConfig> LayerConfigFromFlags();

// "hidden=32 ffn=64 experts=8 top_k=2 softmax silu gated FP32 seed=0 ..." for summaries.
std::string DescribeLayerConfig(const v1::LayerConfig& config);

// moectl's lines for a layer in `status` and `list-layers`: name, config, EP ranks, counts,
// then one line each when its weights were reset or it diverged, saying what mends it.
std::string DescribeLayer(const v1::LayerInfo& layer);

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_LAYER_FLAGS_H_
