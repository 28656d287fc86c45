// The Coordinator's rendezvous key-value store (Gloo addresses, NCCL unique ids), bounded so
// that no caller can grow it or park calls in it without limit:
//   - keys are "g<generation>/..." (server/worker_pool.cc names them so); DropGenerationsBefore
//     (called when a new generation forms) drops the keys of earlier ones, and a Set for an
//     earlier generation is refused, so the store holds one generation's keys;
//   - total bytes (keys + values) and the number of keys are bounded: RESOURCE_EXHAUSTED
//     naming the flag;
//   - parked Gets (waiting for a key not set yet) are bounded in total and per caller (the
//     caller's connection): RESOURCE_EXHAUSTED naming the flag, so they cannot fill the
//     Coordinator's handler pool.
// Only members reach it: the Coordinator checks the cluster secret first.
//
//   RendezvousStore store(RendezvousLimits{});
//   RETURN_IF_ERROR(store.Set("g3/world/rank_0", address));
//   ASSIGN_OR_RETURN(std::string v, store.Get("g3/world/rank_1", absl::Seconds(60), peer,
//                                             [&] { return context->IsCancelled(); }));
#ifndef MOED_SERVER_RENDEZVOUS_STORE_H_
#define MOED_SERVER_RENDEZVOUS_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moe {

struct RendezvousLimits {
  int64_t max_bytes = int64_t{64} << 20;  // --rendezvous_max_bytes
  int64_t max_keys = 65536;               // --rendezvous_max_keys
  int max_waiting = 256;                  // --rendezvous_max_waiting
  int max_waiting_per_caller = 32;        // --rendezvous_max_waiting_per_caller
};

class RendezvousStore {
 public:
  explicit RendezvousStore(RendezvousLimits limits) : limits_(limits) {}

  // Sets (or overwrites) key and wakes the Gets waiting for it. INVALID_ARGUMENT for a key
  // that is not "g<generation>/...", FAILED_PRECONDITION for an earlier generation's key,
  // RESOURCE_EXHAUSTED past the bytes or keys bound.
  absl::Status Set(const std::string& key, const std::string& value);
  // The key's value once set; DEADLINE_EXCEEDED after `timeout`, CANCELLED as soon as
  // cancelled() turns true (polled a few times a second). A Get that has to wait counts
  // against the waiting bounds of all callers and of `caller`: RESOURCE_EXHAUSTED beyond.
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout,
                                  const std::string& caller,
                                  const std::function<bool()>& cancelled);
  // Drops every key of a generation before `generation`; Sets for them are refused from now.
  void DropGenerationsBefore(int64_t generation);

  int64_t bytes() const;
  int64_t keys() const;

 private:
  const RendezvousLimits limits_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t first_generation_ ABSL_GUARDED_BY(mu_) = 0;  // keys before it are dropped
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int> waiting_by_caller_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_RENDEZVOUS_STORE_H_
