#include "server/durable_schedule.h"

namespace moe {

bool DurableSchedule::AfterChange(LayerEntry& layer, bool optimizer_step, bool force,
                                  absl::Time now) const {
  absl::MutexLock lock(&layer.mu);
  if (optimizer_step) ++layer.optimizer_step;
  if (store_ == nullptr) return false;
  if (!optimizer_step) layer.changed_since_durable = true;
  const bool changed =
      layer.changed_since_durable || layer.optimizer_step != layer.durable.optimizer_step;
  if (every_steps_ > 0 && layer.optimizer_step - layer.durable.optimizer_step >= every_steps_) {
    return true;
  }
  if (every_ > absl::ZeroDuration() && changed && now - layer.durable_since >= every_) {
    return true;
  }
  return force;
}

void DurableSchedule::RecordSaved(LayerEntry& layer, const DurableLayer& record, absl::Time now) {
  absl::MutexLock lock(&layer.mu);
  layer.durable = record;
  layer.changed_since_durable = false;
  layer.durable_since = now;
}

void DurableSchedule::RecordLoaded(LayerEntry& layer, const DurableLayer& record, absl::Time now) {
  absl::MutexLock lock(&layer.mu);
  layer.optimizer_step = record.optimizer_step;  // the steps after it are lost
  layer.changed_since_durable = false;
  layer.durable_since = now;
  layer.load_durable = false;
}

}  // namespace moe
