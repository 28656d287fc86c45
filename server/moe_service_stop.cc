// MoeServiceImpl: the graceful stop (SIGTERM / SIGINT; issue 43, server/graceful_stop.h).
// New calls are refused at the handler pool; every layer then gets one last turn, queued
// behind the calls already accepted for it (they run to their end, in arrival order, so the
// last acknowledged step is the one written), and is closed under that turn: a call accepted
// before the stop that reaches its turn later is UNAVAILABLE, so nothing changes a layer
// after its final checkpoint. The checkpoint is the same durable write as the automatic ones
// (SaveDurable: staged, renamed into place, then named by the registry), so a moed that exits
// in the middle of it leaves the layer's previous durable checkpoint, whole.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/moe_service.h"

namespace moe {

void MoeServiceImpl::BeginShutdown(GracefulStopReport* report) {
  handlers_.Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, kShuttingDownMessage));
  // Step channels close after the record they are answering (its answer goes out).
  if (step_channels_ != nullptr) step_channels_->CloseAll();
  layers_.ForEach(
      [report](Layer& layer) { report->Set(layer.name, GracefulStopReport::Outcome::kWaiting); });
}

void MoeServiceImpl::PersistForShutdown(absl::Time deadline, GracefulStopReport* report) {
  const std::vector<std::shared_ptr<Layer>> layers = layers_.List();
  // One thread per layer: a layer behind a long step must not hold up the others' writes.
  std::vector<std::thread> threads;
  for (const std::shared_ptr<Layer>& layer : layers) {
    threads.emplace_back(&MoeServiceImpl::CloseAndPersist, this, layer, deadline, report);
  }
  for (std::thread& thread : threads) thread.join();
}

void MoeServiceImpl::CloseAndPersist(const std::shared_ptr<Layer>& layer, absl::Time deadline,
                                     GracefulStopReport* report) {
  using Outcome = GracefulStopReport::Outcome;
  absl::StatusOr<std::unique_ptr<Turn>> turn =
      TakeTurnUntil(layer, deadline, nullptr, /*require_serving=*/false, /*allow_diverged=*/true);
  if (absl::IsNotFound(turn.status())) {  // deleted meanwhile: nothing of it is kept
    report->Set(layer->name, Outcome::kNotDurable);
    return;
  }
  if (!turn.ok()) {
    report->Set(layer->name, Outcome::kNotPersisted, 0,
                absl::IsDeadlineExceeded(turn.status())
                    ? "its running calls did not finish within --shutdown_grace_s"
                    : std::string(turn.status().message()));
    return;
  }
  bool durable = false, changed = false;
  int64_t step = 0, durable_step = 0;
  {
    absl::MutexLock lock(&layer->mu);
    layer->closed = true;
    durable = options_.durable_store != nullptr && layer->durable.incarnation != 0;
    // A layer restored by this moed whose workers never loaded it holds its durable state.
    changed = !layer->load_durable && (layer->changed_since_durable ||
                                       layer->optimizer_step != layer->durable.optimizer_step);
    step = layer->optimizer_step;
    durable_step = layer->durable.optimizer_step;
  }
  if (!durable) {
    report->Set(layer->name, Outcome::kNotDurable);
    return;
  }
  if (!changed) {
    report->Set(layer->name, Outcome::kAlreadyDurable, durable_step);
    return;
  }
  if ((*turn)->set.size() == 0) {
    report->Set(
        layer->name, Outcome::kNotPersisted, 0,
        absl::StrCat("no serving workers; durable at optimizer step ", durable_step, " of ", step));
    return;
  }
  absl::Status saved = SaveDurable(**turn);
  if (!saved.ok()) {
    {
      absl::MutexLock lock(&layer->mu);
      layer->durable_error = std::string(saved.message());
    }
    report->Set(
        layer->name, Outcome::kNotPersisted, 0,
        absl::StrCat(saved.ToString(), "; durable at optimizer step ", durable_step, " of ", step));
    return;
  }
  report->Set(layer->name, Outcome::kPersisted, step);
}

}  // namespace moe
