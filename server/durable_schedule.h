// DurableSchedule: when a durable layer's state is written into the durable store (moed
// --state_dir, --durable_every_steps, --durable_every_s; server/durable_store.h), and the
// books of a layer's durable state (LayerEntry's optimizer_step, durable, durable_since,
// changed_since_durable, load_durable). It calls no worker and touches no file:
// MoeServiceImpl asks it whether a checkpoint is due after a change, has the workers write
// the checkpoint and the store commit it (moe_service_durable.cc), then records the outcome
// here.
//
//   DurableSchedule schedule(options.durable_store, options.durable_every_steps,
//                            options.durable_every);
//   if (schedule.AfterChange(layer, /*optimizer_step=*/true, /*force=*/false, absl::Now())) {
//     ... the workers write the checkpoint, the store commits it as `record` ...
//     DurableSchedule::RecordSaved(layer, record, absl::Now());
//   }
//
// Every method takes the entry's mu itself: call it with the layer's turn held (so that
// nothing changes the layer between the decision and the write), never under its mu.
#ifndef MOED_SERVER_DURABLE_SCHEDULE_H_
#define MOED_SERVER_DURABLE_SCHEDULE_H_

#include <cstdint>

#include "absl/time/time.h"
#include "server/durable_store.h"
#include "server/layer_entry.h"

namespace moe {

class DurableSchedule {
 public:
  // store: null for no durable state (every AfterChange is then false); every_steps: a
  // checkpoint after this many optimizer steps (<= 0: that trigger is off); every: one once
  // this long passed since the last with something changed (zero: off).
  DurableSchedule(DurableStore* store, int64_t every_steps, absl::Duration every)
      : store_(store), every_steps_(every_steps), every_(every) {}

  // After a change to `layer` succeeded on every worker: counts it (an optimizer step, or a
  // change beyond them) and says whether a durable checkpoint is due now: `force`, or
  // every_steps optimizer steps since the durable one, or `every` passed since it (`now`)
  // with something changed. The optimizer step is counted with no store too.
  bool AfterChange(LayerEntry& layer, bool optimizer_step, bool force, absl::Time now) const;

  // The workers wrote and the store committed `record` (the optimizer step it includes):
  // the layer is durable as of `now`, nothing changed since.
  static void RecordSaved(LayerEntry& layer, const DurableLayer& record, absl::Time now);
  // The workers loaded `record`'s checkpoint (or the layer starts from init_seed when it has
  // none): its optimizer step is the record's (the steps after it are lost), nothing changed
  // since `now`, and its next creation loads nothing more.
  static void RecordLoaded(LayerEntry& layer, const DurableLayer& record, absl::Time now);

 private:
  DurableStore* const store_;
  const int64_t every_steps_;
  const absl::Duration every_;
};

}  // namespace moe

#endif  // MOED_SERVER_DURABLE_SCHEDULE_H_
