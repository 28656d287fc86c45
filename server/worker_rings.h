// moed's same-host step rings to one worker (issue 37 §2; transport/README.md "Phase 2",
// item 4): a few RingChannels per worker of a generation, moed the caller, the worker the
// server. A per-step call (Forward, Backward, ReleaseStep) takes a free channel and goes as one
// record: an envelope (transport/step_envelope.h: its WorkerRingKind, its remaining
// deadline) + exactly the bytes of its gRPC request; the worker runs the same body as its gRPC
// handler on them (server/worker_step_bytes.h) and answers the same bytes. So a step's results
// are the same bit for bit on either path.
//
// Setup (Open, after the generation's Setup): moed creates each region as
// "/moed-worker-ring-<128 random bits>" (mode 0600) and takes its caller slot, sends the names with
// its pid and pid namespace in Worker.OpenStepChannels (proto/worker.proto), unlinks every name
// as soon as that call returns (nothing stays in /dev/shm), and keeps a channel only if the
// worker attached with the pid it joined with.
//
// Faults, as on gRPC: a call waits at most until its deadline (DEADLINE_EXCEEDED), ends
// within one peer check (20 ms) after the worker died (UNAVAILABLE) or the call was
// cancelled (CANCELLED). A channel whose call timed out or was cancelled may still hold the
// worker's late answer and is dropped, and a background thread opens a new one in its place
// (one more OpenStepChannels of the same generation; the worker serves it beside the others),
// so a run of timeouts (a worker stopped for a while, callers with short deadlines) does not
// leave the worker on gRPC. A refill that fails is said once and not tried again; a channel
// error (the worker died or closed, DATA_LOSS, a full ring) makes this worker's calls use gRPC
// until the next generation, with one log line.
//
//   std::shared_ptr<WorkerRings> rings = WorkerRings::Open(rank, generation, pid, stub, options);
//   std::optional<absl::StatusOr<std::string>> answer =
//       rings->Call(WorkerRingKind::kForward, wire, deadline, cancelled);
//   if (!answer.has_value()) { ... send it by gRPC (no free channel, too large, fallen back) }
#ifndef MOED_SERVER_WORKER_RINGS_H_
#define MOED_SERVER_WORKER_RINGS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/worker.grpc.pb.h"
#include "transport/ring_channel.h"

namespace moe {

// The kinds of call a moed -> worker ring carries (the envelope's kind byte).
enum class WorkerRingKind : uint8_t { kForward = 1, kBackward = 2, kReleaseStep = 3 };

struct WorkerRingOptions {
  bool enabled = true;             // --worker_ring
  int channels_per_worker = 4;     // --worker_ring_channels: steps in flight on rings per worker
  uint64_t ring_bytes = 1 << 20;   // each direction's ring (a power of two)
  absl::Duration open_timeout = absl::Seconds(5);  // the OpenStepChannels call
  // moed's wait for a worker's answer spins this long before it sleeps (--ring_spin_us).
  absl::Duration max_spin = absl::ZeroDuration();
};

class WorkerRings {
 public:
  // Opens options.channels_per_worker channels to the worker of `rank` (process `worker_pid`,
  // as it joined) for `generation`. Null when the worker refused them or anything failed (one
  // log line says why; its calls then use gRPC).
  static std::shared_ptr<WorkerRings> Open(int rank, int64_t generation, int64_t worker_pid,
                                           std::shared_ptr<internal::Worker::Stub> stub,
                                           const WorkerRingOptions& options);
  ~WorkerRings();  // cancels a refill in flight and joins its thread

  // Sends `request` (a serialized request of `kind`) on a free channel and returns the
  // worker's answer: its bytes, or the status its handler returned, or a channel error as
  // above. nullopt when it was not sent: every channel busy, the request (or the answer it
  // may have, at most twice its size) too large for a record, or this worker fell back to
  // gRPC. `cancelled` (may be null) is polled while the call waits.
  std::optional<absl::StatusOr<std::string>> Call(WorkerRingKind kind,
                                                  const grpc::ByteBuffer& request,
                                                  absl::Time deadline,
                                                  const std::function<bool()>& cancelled);

  int rank() const { return peer_.rank; }
  size_t free_channels() const;
  // Channels free or in a call, and channels opened in place of dropped ones (tests, metrics).
  int channels() const;
  int64_t refilled() const;

 private:
  struct Peer {  // what opening a channel needs
    int rank = 0;
    int64_t generation = 0;
    int64_t worker_pid = 0;
    std::shared_ptr<internal::Worker::Stub> stub;
    WorkerRingOptions options;
  };
  WorkerRings(Peer peer, std::vector<std::unique_ptr<RingChannel>> channels);
  // Creates `count` channels, has the worker attach them (OpenStepChannels, cancelled through
  // *context_slot when set) and returns those it kept; `why` says why any were not.
  static std::vector<std::unique_ptr<RingChannel>> OpenChannels(
      const Peer& peer, int count, grpc::ClientContext* context, std::string* why);
  // Takes the channel back after a call that ended with `status`, or drops it (above).
  void Return(std::unique_ptr<RingChannel> channel, const absl::Status& status);
  // The refill thread: opens a channel for each one dropped after a timeout.
  void Refill();
  bool RefillDue() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Peer peer_;
  uint64_t max_payload_ = 0;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<RingChannel>> free_ ABSL_GUARDED_BY(mu_);
  int channels_ ABSL_GUARDED_BY(mu_) = 0;  // free or in a call
  bool fell_back_ ABSL_GUARDED_BY(mu_) = false;
  int missing_ ABSL_GUARDED_BY(mu_) = 0;  // dropped after a timeout, not yet replaced
  int64_t refilled_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool refill_failed_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* refill_call_ ABSL_GUARDED_BY(mu_) = nullptr;  // in flight, to cancel
  std::thread refill_thread_;  // started at the first drop
};

// A buffer's bytes in one string (a record's body).
std::string BufferBytes(const grpc::ByteBuffer& buffer);

// True when `status` came from the channel itself (the worker died or closed, a deadline, a
// cancellation, corruption, a full ring), not from the worker's handler.
bool IsRingChannelError(const absl::Status& status);

}  // namespace moe

#endif  // MOED_SERVER_WORKER_RINGS_H_
