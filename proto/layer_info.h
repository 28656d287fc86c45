// What moe.v1 says about a layer beyond its config: the rule for layer names, the layer's
// parameters as LayerInfo.parameters and the weight streams name them, and the ExpertLoad
// statistics of a per-expert token count.
//
//   RETURN_IF_ERROR(ValidateLayerName("name", request.name()));
//   for (const ParameterLayout& p : LayerParameters(config))
//   info.add_parameters()->set_name(p.name); *response.mutable_load() =
//   ComputeLoad(result.tokens_per_expert);
#ifndef MOED_PROTO_LAYER_INFO_H_
#define MOED_PROTO_LAYER_INFO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "proto/moe.pb.h"

namespace moe {

// 1-128 characters of [A-Za-z0-9_.-]; else INVALID_ARGUMENT naming `field`.
absl::Status ValidateLayerName(absl::string_view field, absl::string_view name);

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

// min/max/mean and idle experts of a per-expert count vector.
v1::ExpertLoad ComputeLoad(const std::vector<int64_t>& tokens_per_expert);

}  // namespace moe

#endif  // MOED_PROTO_LAYER_INFO_H_
