// The front end's record of one layer: what moed remembers of it between calls (its config,
// to re-create it when the workers form a new generation; its FIFO turn; the books of its
// saved steps, load, divergence and durable state). moed owns no tensor of it. Entries are
// shared (std::shared_ptr): LayerRegistry lists them by name, and a call keeps the entry it
// found, so that a layer deleted meanwhile is seen as `deleted`, never confused with another
// layer created later under the same name.
//
//   auto layer = std::make_shared<LayerEntry>(name, limits);
//   layer->id = registry.NextLayerId();
//   layer->config = config;
//   RETURN_IF_ERROR(registry.Add(layer));
//   absl::MutexLock lock(&layer->mu);
//   ++layer->forward_count;
//
// Locking: `turn` (one worker operation at a time) is taken before `mu`; `mu` guards the
// books and is held only briefly, never across a worker call. dp_steps has its own lock,
// taken before the turn, never under mu. The registry's lock comes before `mu`.
#ifndef MOED_SERVER_LAYER_ENTRY_H_
#define MOED_SERVER_LAYER_ENTRY_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/config.h"
#include "server/data_parallel_steps.h"
#include "server/durable_store.h"
#include "server/fifo_mutex.h"
#include "server/saved_steps.h"

namespace moe {

struct LayerEntry {
  LayerEntry(std::string layer_name, SavedStepLimits limits)
      : name(std::move(layer_name)), saved(name, limits) {}
  // Set before the entry is listed (LayerRegistry::Add / Restore), constant after: read
  // without a lock.
  std::string name;
  uint64_t id = 0;  // LayerRegistry::NextLayerId: the workers' name for this instance
  LayerConfig config;
  FifoMutex turn;  // one worker operation at a time, in arrival order
  mutable absl::Mutex mu;
  bool deleted ABSL_GUARDED_BY(mu) = false;
  bool weights_reset ABSL_GUARDED_BY(mu) = false;  // see LayerInfo.weights_reset
  SavedSteps saved ABSL_GUARDED_BY(mu);
  int64_t forward_count ABSL_GUARDED_BY(mu) = 0;
  std::vector<int64_t> accumulated ABSL_GUARDED_BY(mu);  // [E] since the last bias update
  // Why the workers may hold different state of this layer (LayerInfo.diverged); empty
  // while they agree. gradients_only: only gradients may differ (ZeroGradients mends it).
  std::string diverged ABSL_GUARDED_BY(mu);
  // LayerInfo.fp8_gemms, from the workers' CreateLayer answers.
  std::string fp8_gemms ABSL_GUARDED_BY(mu);
  bool diverged_gradients_only ABSL_GUARDED_BY(mu) = false;
  // Durable state (ServiceOptions::durable_store; LayerInfo.optimizer_step, durable_*).
  int64_t optimizer_step ABSL_GUARDED_BY(mu) = 0;
  DurableLayer durable ABSL_GUARDED_BY(mu);  // the store's record; incarnation 0: none
  bool changed_since_durable ABSL_GUARDED_BY(mu) = false;  // beyond optimizer steps
  absl::Time durable_since ABSL_GUARDED_BY(mu);            // for durable_every
  std::string durable_error ABSL_GUARDED_BY(mu);
  // Data-parallel ApplyOptimizer steps (num_ranks > 1): their ranks' calls, the answers of
  // the last applied ones. Its own lock; taken before the turn, never under mu.
  DataParallelSteps dp_steps;
  // Restored from the store by this moed: its first creation on the workers loads the
  // durable checkpoint, whatever instances they hold (their layer ids are another moed's).
  bool load_durable ABSL_GUARDED_BY(mu) = false;
  // A re-formation or this moed's restore dropped the gradients since the last
  // ZeroGradients or optimizer step: a conditional ApplyOptimizer (expected_optimizer_step)
  // is ABORTED until one of those clears it, so no step is taken from partial gradients.
  bool gradients_dropped ABSL_GUARDED_BY(mu) = false;
  // The graceful stop took its last turn: no call runs on it any more.
  bool closed ABSL_GUARDED_BY(mu) = false;
  void ClearDiverged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    diverged.clear();
    diverged_gradients_only = false;
  }
};

}  // namespace moe

#endif  // MOED_SERVER_LAYER_ENTRY_H_
