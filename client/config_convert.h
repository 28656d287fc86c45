// moe.v1.LayerConfig (wire) <-> moe::LayerConfig (engine), independent of the server's own
// conversion so that `moectl smoke` checks the server's reading of a config rather than
// sharing it. Applies the defaults documented in proto/moe.proto for unset fields.
//
//   ASSIGN_OR_RETURN(moe::LayerConfig config, moe::client::EngineConfigFromProto(info.config()));
#ifndef MOED_CLIENT_CONFIG_CONVERT_H_
#define MOED_CLIENT_CONFIG_CONVERT_H_

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "proto/moe.pb.h"

namespace moe {
namespace client {

// INVALID_ARGUMENT for an enum value or compute_dtype this client does not know. Does not run
// ValidateConfig (that needs the number of ranks; the server checks it).
absl::StatusOr<LayerConfig> EngineConfigFromProto(const v1::LayerConfig& proto);
// Every field set explicitly.
v1::LayerConfig ProtoFromEngineConfig(const LayerConfig& config);

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_CONFIG_CONVERT_H_
