// Worker memory estimates for admission control (moed's --worker_memory_bytes): what a layer
// holds on one worker, and what one Forward or Backward step may allocate there, computed
// from the layer's config and the step's token count before any worker is called.
//
// The step bounds follow what engine/moe_layer_forward.cc, moe_layer_experts.cc and
// moe_layer_backward.cc allocate, with the worst-case routing: every token of every rank
// sends min(k, E/R) of its k pairs to one rank's experts (bounded by capacity_factor when it
// is set), plus align_size padding of every (source rank, expert) pair. So a step admitted by
// these bounds cannot allocate more on any worker, whatever the router does; typical steps
// use a fraction (balanced routing: 1/R of the expert rows).
//
//   const int64_t need = ForwardStepBytes(config, tokens, ranks, DType::kBFloat16);
//   held += LayerBytesPerWorker(config, ranks, fraction);  // fraction: the workers' answer
//   if (held + need > budget) return absl::ResourceExhaustedError(...);
#ifndef MOED_SERVER_STEP_MEMORY_H_
#define MOED_SERVER_STEP_MEMORY_H_

#include <cstdint>

#include "engine/config.h"
#include "engine/dtype.h"

namespace moe {

// Bytes one worker (of `ranks`) holds for the layer once it trains: every parameter of its
// shard (the replicated gate and expert bias, its E/R experts) in fp32, with its gradient and
// two optimizer states where it has a gradient (as --max_layer_bytes counts them), plus the
// experts' compute-dtype copies when the compute dtype is not FP32, plus the deferred
// weight-gradient operands a layer may keep between calls with the workers'
// `deferred_wgrad_fraction` (DeferredWgradBudgetBytes, engine/config.h).
int64_t LayerBytesPerWorker(const LayerConfig& config, int ranks, double deferred_wgrad_fraction);

// Bytes one worker may allocate during a Forward of `tokens` tokens (the whole step, split
// over `ranks` workers as moed splits it) with activations of `x_dtype`: the saved step
// (kept for Backward or freed at the end) and the step's working buffers, at worst-case
// routing. Saturates at INT64_MAX.
int64_t ForwardStepBytes(const LayerConfig& config, int64_t tokens, int ranks, DType x_dtype);

// Bytes one worker may allocate during the Backward of a step of `tokens` tokens, beyond the
// saved step it consumes (counted where it was kept). With deferral on, the backward that runs
// the deferred weight gradients also gathers every deferred backward's rows and its own, for
// one weight at a time: at most the budget (what LayerBytesPerWorker counts as kept) plus its
// own rows of that weight's two operands.
int64_t BackwardStepBytes(const LayerConfig& config, int64_t tokens, int ranks, DType x_dtype,
                          double deferred_wgrad_fraction);

}  // namespace moe

#endif  // MOED_SERVER_STEP_MEMORY_H_
