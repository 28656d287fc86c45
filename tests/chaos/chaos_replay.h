// The chaos test's layers, their deterministic step inputs, and the local replay its final
// weights are checked against (tests/server/chaos_test.cc).
//
//   ChaosLayer plan = ChaosLayerPlan(0, /*shared=*/false);
//   StepInputs inputs = ChaosInputs(plan, /*step=*/1);        // x and d_out of step 1
//   ASSIGN_OR_RETURN(auto weights, ReplayChaosLayer(plan, /*ranks=*/2, /*steps=*/7));
//
// The replay runs the engine as the workers do: `ranks` ranks as threads of this process over
// one Gloo group (loopback), each with the rows moed gives its worker (T/R, plus one for
// r < T%R), Backward with d_aux = d_z_loss = 1 (moed's defaults), then ApplyOptimizer. So its
// weights are bit for bit those of a cluster of that many workers that took the same steps.
#ifndef MOED_TESTS_CHAOS_CHAOS_REPLAY_H_
#define MOED_TESTS_CHAOS_CHAOS_REPLAY_H_

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/moe.pb.h"

namespace moe {

constexpr int64_t kChaosTokens = 25;  // odd: the two workers get 13 and 12 rows

struct ChaosLayer {
  std::string name;
  v1::LayerConfig config;
  v1::ApplyOptimizerRequest optimizer;  // sgd or adamw set; layer and expectation unset
};

// Layer `index`: alternately SGD with momentum and AdamW (both keep optimizer state that a
// restore must bring back); `shared` names the layer every client trains.
ChaosLayer ChaosLayerPlan(int index, bool shared);

struct StepInputs {
  int64_t hidden = 0;
  std::vector<float> x;      // [kChaosTokens, hidden]
  std::vector<float> d_out;  // [kChaosTokens, hidden]
};
// The inputs of optimizer step `step` (1-based) of the layer: a function of both only.
StepInputs ChaosInputs(const ChaosLayer& layer, int64_t step);

// The layer's whole-layer fp32 parameters (GetWeights' names and layout) after `steps`
// optimizer steps from init_seed, computed on `ranks` in-process ranks.
absl::StatusOr<std::map<std::string, std::vector<float>>> ReplayChaosLayer(const ChaosLayer& layer,
                                                                           int ranks,
                                                                           int64_t steps);

inline bool BitEqual(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

}  // namespace moe

#endif  // MOED_TESTS_CHAOS_CHAOS_REPLAY_H_
