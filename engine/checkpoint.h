// Layer checkpoints that store experts, not ranks: a checkpoint saved at EP = R loads at any
// EP = R' (R' dividing E), because every expert has its own file.
//
//   RETURN_IF_ERROR(SaveCheckpoint(*layer, "/ckpt/layer0"));   // on every rank
//   RETURN_IF_ERROR(LoadCheckpoint(layer.get(), "/ckpt/layer0"));  // on every rank
//
// Both calls are collective over the layer's communicator (every rank calls them, in the same
// order as its other collectives), and every rank must see the same directory (one host, or a
// shared file system across hosts). Directory layout:
//   config.txt          ConfigToString(config) and a newline            (rank 0)
//   router.bin          "gate" [H, E], "expert_bias" [E] (use_expert_bias), router optimizer
//                       state ("gate.m", "gate.v") and "step" [1]      (rank 0)
//   expert_NNNNN.bin    expert e (5 digits): "wi" [H, up], "wo" [F, H], "wi_bias" [up],
//                       "wo_bias" [H] (use_bias) and their state "<name>.m"/"<name>.v"
//                       (the owning rank)
//   fp8_rank_RRRRR_of_NNNNN.bin   FP8 with delayed scaling only: rank R of N's amax histories,
//                       "fp8.amax_history" [4, len] and "fp8.amax_steps" [4] (each rank;
//                       loaded by rank R of N only, with the same fp8_amax_history_len;
//                       otherwise, and from checkpoints without the file, the history
//                       starts empty)
//   COMPLETE            written by rank 0 last, once every rank has written its files
// Every file is a tensor file of engine/checkpoint_file.h (checksummed, written atomically).
// All tensors are fp32 masters. The accumulated expert counts of UpdateExpertBias are not
// saved: they restart at zero after a load, as after an update.
//
// Load reads and verifies every file this rank needs (COMPLETE, config, router, its experts)
// and agrees with the other ranks that all of them succeeded before it changes anything:
//   - missing directory or file: NOT_FOUND naming it (missing COMPLETE: DATA_LOSS, the save
//     did not finish);
//   - truncated or corrupted file, or a tensor whose name, dtype or shape does not fit the
//     config: DATA_LOSS naming the file;
//   - checkpoint config differs from the layer's: FAILED_PRECONDITION. init_seed and
//     compute_dtype and the fp8_ knobs may differ (they do not change what the masters mean).
// Optimizer state the layer holds but the checkpoint lacks is reset to zero (a fresh state).
#ifndef MOED_ENGINE_CHECKPOINT_H_
#define MOED_ENGINE_CHECKPOINT_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/moe_layer.h"
#include "engine/tensor.h"

namespace moe {

absl::Status SaveCheckpoint(const MoeLayer& layer, const std::string& dir);
absl::Status LoadCheckpoint(MoeLayer* layer, const std::string& dir);

// The two halves of LoadCheckpoint for a caller that agrees across ranks by itself (moed's
// two-phase load: every worker stages, and only when all succeeded does any commit).
// StageCheckpoint reads and verifies the files this rank needs, with LoadCheckpoint's
// errors, and changes nothing (no collective); InstallCheckpoint puts a staged checkpoint
// into the layer it was staged for (fails only on a backend error).
struct StagedCheckpoint {
  std::map<std::string, Tensor> params;  // gate, expert_bias, and [El, ...] expert tensors
  std::map<std::string, Tensor> states;  // same convention
};
absl::StatusOr<StagedCheckpoint> StageCheckpoint(const MoeLayer& layer, const std::string& dir);
absl::Status InstallCheckpoint(MoeLayer* layer, const StagedCheckpoint& staged);

// Reads and verifies every file of the checkpoint in `dir` (COMPLETE, config, router and all
// E experts) against `config`, with StageCheckpoint's errors, holding one file at a time and
// keeping nothing; no layer and no collective (moed checks its durable state at start).
absl::Status VerifyCheckpoint(const LayerConfig& config, const std::string& dir);

// "expert_00042.bin" for expert 42.
std::string ExpertFileName(int64_t expert);

}  // namespace moe

#endif  // MOED_ENGINE_CHECKPOINT_H_
