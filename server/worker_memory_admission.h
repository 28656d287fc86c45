// moed's admission control by estimated worker memory (--worker_memory_bytes): whether a
// CreateLayer, Forward or Backward may run, decided before any worker allocates.
//
// A call is refused with RESOURCE_EXHAUSTED when what it needs per worker (server/step_memory.h:
// the layer's shard, or the step's worst-case working memory), plus what the workers already
// hold (every layer's shard, with the deferred weight-gradient operands it may keep at the
// fraction the workers report, and the steps kept for backward), plus what the calls admitted
// before it and still running reserved (server/worker_memory_reservations.h), passes the
// budget. A refusal is immediate: nothing waits for memory to become free.
//
// This class holds the budget and the reservations; what the workers hold it reads from the
// front end's books through `Books` (no gRPC, no layer registry of its own), so tests run it
// without a server.
//
//   WorkerMemoryAdmission admission(options.worker_memory_bytes, pool.world_size(), books);
//   const int64_t need = ForwardStepBytes(config, tokens, ranks, dtype);
//   RETURN_IF_ERROR(admission.Admit("Forward", name, tokens, need));  // alone, at arrival
//   ... the layer's turn ...
//   RETURN_IF_ERROR(admission.Admit("Forward", name, tokens, need, &turn.memory));  // beside
//   ... the step runs; turn.memory gives its bytes back when it ends.    // the running calls
//
// Thread-safe. Locking: the reservations' lock is taken before any lock Books::for_each_layer
// takes (the front end's registry and layers), never after.
#ifndef MOED_SERVER_WORKER_MEMORY_ADMISSION_H_
#define MOED_SERVER_WORKER_MEMORY_ADMISSION_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "proto/moe.pb.h"
#include "server/worker_memory_reservations.h"

namespace moe {

class WorkerMemoryAdmission {
 public:
  // One layer on the front end's books: its config and the bytes of its steps kept for
  // backward, summed over the workers (SavedSteps::bytes).
  using LayerVisitor = std::function<void(const LayerConfig& config, int64_t saved_bytes)>;

  // What the front end knows of the workers and its layers, read at every check. Every
  // function must be set; none may call back into this object.
  struct Books {
    // The workers' statuses (memory_capacity_bytes, device, address; WorkerPool::
    // WorkerStatuses): the derived budget's source.
    std::function<std::vector<v1::WorkerStatus>()> worker_statuses;
    // The largest deferred_wgrad_fraction the workers reported; empty while none did
    // (WorkerPool::LargestDeferredWgradFraction).
    std::function<std::optional<double>()> reported_deferred_wgrad_fraction;
    // Calls `visit` once for every layer on the books (a layer being deleted is not: its
    // bytes are held by HoldLeavingLayer). Runs under the reservations' lock.
    std::function<void(const LayerVisitor& visit)> for_each_layer;
  };

  // worker_memory_bytes: > 0 the budget per worker; 0 derived from the workers' reported
  // memory (Budget); < 0 off. world_size: the workers a layer is sharded over.
  WorkerMemoryAdmission(int64_t worker_memory_bytes, int world_size, Books books);
  WorkerMemoryAdmission(const WorkerMemoryAdmission&) = delete;
  WorkerMemoryAdmission& operator=(const WorkerMemoryAdmission&) = delete;

  // OK when `need` more bytes per worker fit in Budget() beside what the workers hold
  // (HeldBytes) and, with `reserve`, what the calls running now reserved; then *reserve holds
  // `need` until it is released. Else RESOURCE_EXHAUSTED at once (it never waits), naming the
  // call, the layer, the step's tokens (tokens < 0: none), the figures and
  // --worker_memory_bytes. Without `reserve`: the check at arrival, of the call alone (it could
  // not run even with nothing else running); a step then checks again with `reserve` = its
  // turn's memory once it has its layer's turn. OK whenever the budget is 0 (off, or nothing
  // reported yet).
  absl::Status Admit(absl::string_view call, absl::string_view layer, int64_t tokens,
                     int64_t need, WorkerMemoryReservations::Reservation* reserve = nullptr);

  // Reserves, without a check, the bytes of a layer about to leave the books that its workers
  // still hold for a while (DeleteLayer, until they dropped it). Take it before the layer
  // leaves the books, so that it is never uncounted.
  WorkerMemoryReservations::Reservation HoldLeavingLayer(const LayerConfig& config,
                                                         int64_t saved_bytes);

  // Bytes per worker: worker_memory_bytes when > 0, else derived from the workers' reported
  // memory (90% of a GPU's; 80% of a host's physical memory, divided among the CPU workers
  // that report that host; the smallest over the workers); 0 when off or nothing is known yet.
  // *derived says which.
  int64_t Budget(bool* derived) const;
  // The deferral budget's fraction the estimates count (LayerBytesPerWorker,
  // BackwardStepBytes): the largest the workers report, or kDefaultDeferredWgradFraction
  // while none has.
  double DeferredWgradFraction() const;
  // What one worker holds (estimated): the sum of LayerHeldBytes over the books' layers.
  int64_t HeldBytes() const;
  // One layer's part of it: its LayerBytesPerWorker and its kept steps' bytes per worker,
  // rounded up; saturates at INT64_MAX.
  int64_t LayerHeldBytes(const LayerConfig& config, int64_t saved_bytes,
                         double deferred_wgrad_fraction) const;
  // The bytes reserved by calls running now (moed_worker_memory_reserved_bytes).
  int64_t reserved() const { return reservations_.reserved(); }

 private:
  const int64_t worker_memory_bytes_;
  const int world_size_;
  const Books books_;
  // The worker memory of admitted calls still running. Its lock is taken before the books'
  // locks (TryReserve reads HeldBytes under it), never after.
  WorkerMemoryReservations reservations_;
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_MEMORY_ADMISSION_H_
