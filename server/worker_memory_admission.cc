// WorkerMemoryAdmission: admission control by estimated worker memory (--worker_memory_bytes).
//
// When: a step is checked alone when it arrives (one that could not run even with nothing else
// running is refused without waiting for its layer's turn), then again, counting the running
// calls, once it has the turn; admitted there, it reserves its estimate until it ends (its
// Turn's memory: released on every exit path, before the turn; an overdue call's after the
// workers finished it). So steps of different layers running at the same time are summed,
// while a step queued behind its own layer's steps holds nothing and is not refused for them
// (they run before it, not beside it). A Backward also moves the saved step it consumes from
// the books into its reservation (the workers free it only as it ends). A CreateLayer (whose
// turn is immediate) reserves its shard at once, until the layer is listed and counted with the
// others.
//
// A layer DeleteLayer takes off the books stays reserved until the workers dropped it (after
// its running step), or until the DeleteLayer gave up waiting for that step (HoldLeavingLayer).
//
// Not covered: calls other than these three (weights, checkpoints, optimizer steps allocate
// little beyond the layer), a deleted layer the workers keep until their next re-formation
// (DeleteLayer timed out), memory the workers' allocator or communicator keeps beyond the
// engine's buffers, and moed's own memory.
#include "server/worker_memory_admission.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/step_memory.h"

namespace moe {
namespace {

// The host part of a worker's "host:port" (the whole string when it has no port).
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

WorkerMemoryAdmission::WorkerMemoryAdmission(int64_t worker_memory_bytes, int world_size,
                                             Books books)
    : worker_memory_bytes_(worker_memory_bytes),
      world_size_(world_size),
      books_(std::move(books)) {}

int64_t WorkerMemoryAdmission::Budget(bool* derived) const {
  *derived = false;
  if (worker_memory_bytes_ > 0) return worker_memory_bytes_;
  if (worker_memory_bytes_ < 0) return 0;
  *derived = true;
  const std::vector<v1::WorkerStatus> workers = books_.worker_statuses();
  // CPU workers on one host share its memory.
  std::map<std::string, int> cpu_workers_on;
  for (const v1::WorkerStatus& w : workers) {
    if (w.memory_capacity_bytes() > 0 && w.device().rfind("cuda", 0) != 0) {
      ++cpu_workers_on[HostOf(w.address())];
    }
  }
  long double budget = 0;
  bool any = false;
  for (const v1::WorkerStatus& w : workers) {
    if (w.memory_capacity_bytes() <= 0) continue;
    const long double capacity = static_cast<long double>(w.memory_capacity_bytes());
    const long double share = w.device().rfind("cuda", 0) == 0
                                  ? capacity * 0.9L
                                  : capacity * 0.8L / cpu_workers_on[HostOf(w.address())];
    budget = any ? std::min(budget, share) : share;
    any = true;
  }
  return any ? static_cast<int64_t>(budget) : 0;
}

double WorkerMemoryAdmission::DeferredWgradFraction() const {
  return books_.reported_deferred_wgrad_fraction().value_or(kDefaultDeferredWgradFraction);
}

int64_t WorkerMemoryAdmission::HeldBytes() const {
  const double fraction = DeferredWgradFraction();
  long double held = 0;
  books_.for_each_layer([&](const LayerConfig& config, int64_t saved_bytes) {
    held += static_cast<long double>(LayerHeldBytes(config, saved_bytes, fraction));
  });
  return held >= static_cast<long double>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(held);
}

int64_t WorkerMemoryAdmission::LayerHeldBytes(const LayerConfig& config, int64_t saved_bytes,
                                              double deferred_wgrad_fraction) const {
  const int ranks = std::max(world_size_, 1);
  long double held =
      static_cast<long double>(LayerBytesPerWorker(config, ranks, deferred_wgrad_fraction));
  held += static_cast<long double>(saved_bytes) / ranks;
  return held >= static_cast<long double>(INT64_MAX) ? INT64_MAX
                                                     : static_cast<int64_t>(std::ceil(held));
}

WorkerMemoryReservations::Reservation WorkerMemoryAdmission::HoldLeavingLayer(
    const LayerConfig& config, int64_t saved_bytes) {
  return reservations_.Hold(LayerHeldBytes(config, saved_bytes, DeferredWgradFraction()));
}

absl::Status WorkerMemoryAdmission::Admit(absl::string_view call, absl::string_view layer,
                                          int64_t tokens, int64_t need,
                                          WorkerMemoryReservations::Reservation* reserve) {
  bool derived = false;
  const int64_t budget = Budget(&derived);
  if (budget <= 0) return absl::OkStatus();
  int64_t held = 0;
  int64_t in_flight = 0;
  if (reserve != nullptr) {
    if (reservations_.TryReserve(
            need, budget, [this] { return HeldBytes(); }, reserve, &held, &in_flight)) {
      return absl::OkStatus();
    }
  } else {
    held = HeldBytes();
    if (static_cast<long double>(held) + static_cast<long double>(need) <=
        static_cast<long double>(budget)) {
      return absl::OkStatus();
    }
  }
  const std::string what =
      tokens < 0 ? absl::StrCat(call, " of layer \"", layer, "\"")
                 : absl::StrCat(call, " of ", tokens, " tokens on layer \"", layer, "\"");
  const std::string running =
      reserve == nullptr ? std::string()
                         : absl::StrCat(
                               ", and the calls running now (steps of other layers, layers being "
                               "created or deleted) reserve ",
                               in_flight, " more");
  return absl::ResourceExhaustedError(absl::StrCat(
      what, " needs an estimated ", need,
      " bytes per worker (worst case; server/step_memory.h), and the workers hold ", held,
      " already (layers' parameters, gradients and optimizer state; steps kept for backward)",
      running, "; the limit is ", budget, " bytes per worker (--worker_memory_bytes",
      derived ? ", derived from the memory the workers report" : "",
      "). Nothing ran: send fewer tokens per call, ",
      in_flight > 0 ? "retry once the running calls ended, " : "",
      "release kept steps or delete layers, or raise --worker_memory_bytes"));
}

}  // namespace moe
