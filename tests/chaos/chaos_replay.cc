#include "tests/chaos/chaos_replay.h"

#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/comm/memory_kv_store.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/moe_layer.h"
#include "engine/status_macros.h"
#include "proto/config_convert.h"
#include "proto/layer_info.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using Parameters = std::map<std::string, std::vector<float>>;

// Rows [first, first + count) of a [T, H] matrix, as a tensor.
Tensor Rows(const std::vector<float>& values, int64_t hidden, int64_t first, int64_t count) {
  return Tensor::FromFloats({count, hidden},
                            std::vector<float>(values.begin() + first * hidden,
                                               values.begin() + (first + count) * hidden));
}

// One rank of the replay: its shard of every parameter after `steps` steps.
absl::StatusOr<Parameters> ReplayRank(const ChaosLayer& plan, const LayerConfig& config,
                                      const OptimizerConfig& optimizer,
                                      std::shared_ptr<KeyValueStore> store, int rank, int ranks,
                                      int64_t steps) {
  ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                   MakeGlooCommunicator(store, "replay", rank, ranks, CommOptions{},
                                        GlooTransportOptions{"", "127.0.0.1"}));
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  ASSIGN_OR_RETURN(std::unique_ptr<MoeLayer> layer,
                   MoeLayer::Create(config, backend.get(), comm.get()));
  // moed's token split: T/R rows each, one more for the first T%R ranks.
  const int64_t count = kChaosTokens / ranks + (rank < kChaosTokens % ranks ? 1 : 0);
  const int64_t first =
      rank * (kChaosTokens / ranks) + std::min<int64_t>(rank, kChaosTokens % ranks);
  for (int64_t step = 1; step <= steps; ++step) {
    const StepInputs inputs = ChaosInputs(plan, step);
    std::unique_ptr<StepContext> saved;
    RETURN_IF_ERROR(layer->Forward(Rows(inputs.x, inputs.hidden, first, count), &saved).status());
    RETURN_IF_ERROR(
        layer->Backward(*saved, Rows(inputs.d_out, inputs.hidden, first, count), 1.0, 1.0)
            .status());
    RETURN_IF_ERROR(layer->ApplyOptimizer(optimizer));
  }
  Parameters shard;
  for (const std::string& name : layer->ParameterNames()) {
    ASSIGN_OR_RETURN(Tensor value, layer->GetParameter(name));
    shard[name] = TensorFloats(value);
  }
  return shard;
}

}  // namespace

ChaosLayer ChaosLayerPlan(int index, bool shared) {
  ChaosLayer layer;
  layer.name = shared ? "shared" : absl::StrCat("client", index);
  layer.config = TinyConfig(100 + index);
  if (index % 2 == 0) {
    layer.optimizer.mutable_sgd()->set_lr(0.05);
    layer.optimizer.mutable_sgd()->set_momentum(0.9);
  } else {
    layer.optimizer.mutable_adamw()->set_lr(1e-2);
    layer.optimizer.mutable_adamw()->set_weight_decay(0.01);
  }
  return layer;
}

StepInputs ChaosInputs(const ChaosLayer& layer, int64_t step) {
  StepInputs inputs;
  inputs.hidden = layer.config.hidden();
  const uint32_t seed = static_cast<uint32_t>(layer.config.init_seed() * 100003 + step * 2);
  inputs.x = RandomFloats(kChaosTokens * inputs.hidden, seed);
  inputs.d_out = RandomFloats(kChaosTokens * inputs.hidden, seed + 1);
  return inputs;
}

absl::StatusOr<Parameters> ReplayChaosLayer(const ChaosLayer& layer, int ranks, int64_t steps) {
  ASSIGN_OR_RETURN(const LayerConfig config, ConfigFromProto(layer.config));
  ASSIGN_OR_RETURN(
      const OptimizerConfig optimizer,
      OptimizerFromProto(layer.optimizer.has_sgd() ? &layer.optimizer.sgd() : nullptr,
                         layer.optimizer.has_adamw() ? &layer.optimizer.adamw() : nullptr));
  auto store = std::make_shared<MemoryKeyValueStore>();
  std::vector<absl::StatusOr<Parameters>> shards(ranks, Parameters());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back(
        [&, r] { shards[r] = ReplayRank(layer, config, optimizer, store, r, ranks, steps); });
  }
  for (std::thread& thread : threads) thread.join();
  for (const auto& shard : shards) RETURN_IF_ERROR(shard.status());
  // Whole-layer tensors as GetWeights streams them: expert-sharded ones concatenated in rank
  // order (row-major along experts), replicated ones from rank 0.
  Parameters whole;
  for (const ParameterLayout& parameter : LayerParameters(config)) {
    std::vector<float>& out = whole[parameter.name];
    for (int r = 0; r < (parameter.expert_sharded ? ranks : 1); ++r) {
      const std::vector<float>& part = shards[r]->at(parameter.name);
      out.insert(out.end(), part.begin(), part.end());
    }
  }
  return whole;
}

}  // namespace moe
