// libFuzzer target: a moe.v1.LayerConfig from the wire (CreateLayer) through
// proto/config_convert.cc's ConfigFromProto and the engine's ValidateConfig; an accepted
// config converts back and is accepted again.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "proto/config_convert.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moe::v1::LayerConfig proto;
  if (!proto.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<moe::LayerConfig> config = moe::ConfigFromProto(proto);
  if (!config.ok()) return 0;
  if (!moe::ConfigFromProto(moe::ConfigToProto(*config)).ok()) std::abort();
  // CreateLayer's validation, for the world sizes a cluster has.
  for (int ranks : {1, 2, 3, 8}) (void)moe::ValidateConfig(*config, ranks);
  return 0;
}
