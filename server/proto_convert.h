// Conversions between the public protos (proto/moe.proto) and the engine's types, with the
// validation every edge needs: tensors (datatype, shape, byte count), layer configs (enum
// ranges, defaults), optimizer configs, layer names, and the per-parameter layout of a layer.
// Every error is INVALID_ARGUMENT naming the field as the request spells it.
//
//   ASSIGN_OR_RETURN(Tensor x, TensorFromProto("x", request.x()));
//   ASSIGN_OR_RETURN(LayerConfig config, ConfigFromProto(request.config()));
#ifndef MOED_SERVER_PROTO_CONVERT_H_
#define MOED_SERVER_PROTO_CONVERT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "engine/moe_layer.h"
#include "engine/tensor.h"
#include "proto/moe.pb.h"

namespace moe {

// Parses datatype, checks shape >= 0 and raw byte count (engine CheckByteCount), copies.
absl::StatusOr<Tensor> TensorFromProto(absl::string_view field, const v1::Tensor& proto);
void TensorToProto(const Tensor& tensor, v1::Tensor* proto);

// Checks only datatype, shape and byte count without copying the bytes.
absl::StatusOr<DType> CheckTensorProto(absl::string_view field, const v1::Tensor& proto);

// Applies the documented defaults (top_k 1, scaling 1.0, gated true, FP32, softmax, silu).
// Does not run ValidateConfig (which needs the number of ranks).
absl::StatusOr<LayerConfig> ConfigFromProto(const v1::LayerConfig& proto);
// Every field set explicitly (the "config as applied" of LayerInfo).
v1::LayerConfig ConfigToProto(const LayerConfig& config);

// sgd or adamw from the oneof; neither, or an out-of-range value, is INVALID_ARGUMENT.
absl::StatusOr<OptimizerConfig> OptimizerFromProto(const v1::SgdOptimizer* sgd,
                                                   const v1::AdamWOptimizer* adamw);

// 1-128 characters of [A-Za-z0-9_.-].
absl::Status ValidateLayerName(absl::string_view field, absl::string_view name);

// min/max/mean and idle experts of a per-expert count vector.
v1::ExpertLoad ComputeLoad(const std::vector<int64_t>& tokens_per_expert);

// One parameter of a layer: its whole-layer shape, and whether it is split over the EP
// ranks along its first dimension (experts) or replicated on every rank.
struct ParameterLayout {
  std::string name;
  std::vector<int64_t> shape;  // whole layer, e.g. wi [E, H, up]
  bool expert_sharded = false;
  bool has_gradient = true;
};
// In a fixed order: gate, expert_bias (use_expert_bias), wi, wo, wi_bias, wo_bias (use_bias).
std::vector<ParameterLayout> LayerParameters(const LayerConfig& config);

}  // namespace moe

#endif  // MOED_SERVER_PROTO_CONVERT_H_
