// moe.v1.LayerConfig and the optimizer messages (wire) <-> the engine's LayerConfig and
// OptimizerConfig, for the front end, the workers and the client alike. The defaults of
// LayerConfig's unset fields (proto/moe.proto) are written here and nowhere else. Every error
// is INVALID_ARGUMENT naming the field as the request spells it.
//
//   ASSIGN_OR_RETURN(LayerConfig config, ConfigFromProto(request.config()));
//   *info.mutable_config() = ConfigToProto(config);  // every field set: the config as applied
#ifndef MOED_PROTO_CONFIG_CONVERT_H_
#define MOED_PROTO_CONFIG_CONVERT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/moe_layer.h"
#include "proto/moe.pb.h"

namespace moe {

// Defaults of LayerConfig's optional fields. An unset enum means softmax and silu, an empty
// compute_dtype FP32; every other field defaults to zero / false.
inline constexpr int64_t kDefaultTopK = 1;
inline constexpr double kDefaultScalingFactor = 1.0;
inline constexpr bool kDefaultGated = true;
inline constexpr DType kDefaultComputeDType = DType::kFloat32;

// Applies the defaults above; an unknown enum value or compute_dtype is INVALID_ARGUMENT.
// Does not run ValidateConfig (which needs the number of ranks; the server runs it).
absl::StatusOr<LayerConfig> ConfigFromProto(const v1::LayerConfig& proto);
// Every field set explicitly (the "config as applied" of LayerInfo).
v1::LayerConfig ConfigToProto(const LayerConfig& config);

// sgd or adamw from the oneof; neither, or an out-of-range value, is INVALID_ARGUMENT.
absl::StatusOr<OptimizerConfig> OptimizerFromProto(const v1::SgdOptimizer* sgd,
                                                   const v1::AdamWOptimizer* adamw);

}  // namespace moe

#endif  // MOED_PROTO_CONFIG_CONVERT_H_
