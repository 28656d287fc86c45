// ClientStepChannel: a MoeClient's step channel (proto/moe.proto "Step channels";
// transport/README.md "Phase 2", item 5): Forward / Backward / ReleaseStep as records in a
// shared-memory ring instead of a gRPC call each, when moed is on this host. Opened at the
// first step; moed refusing it (UNIMPLEMENTED: no --allow_client_shm, PERMISSION_DENIED: not
// on its host, or any other error) or the channel failing later (UNAVAILABLE, DATA_LOSS: moed
// closed it or exited) turns it off for good with one line on stderr, and the steps go over
// gRPC. One step at a time: a step that finds it busy goes over gRPC.
//
//   ClientStepChannel channel(stub, token, 8 << 20);
//   std::optional<absl::StatusOr<std::string>> answer =
//       channel.Call(StepKind::kForward, request_bytes, answer_bytes, absl::Seconds(60));
//   if (!answer.has_value()) { ... the gRPC call ... }
#ifndef MOED_CLIENT_STEP_CHANNEL_H_
#define MOED_CLIENT_STEP_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/moe.grpc.pb.h"
#include "transport/ring_channel.h"

namespace moe {
namespace client {

// The record kinds (transport/step_envelope.h; server/step_caller.h StepRecordKind).
enum class StepKind : uint8_t { kForward = 1, kBackward = 2, kReleaseStep = 3 };

// Whether a gRPC target names this host: unix:, localhost, a loopback address.
bool IsLocalTarget(absl::string_view target);

class ClientStepChannel {
 public:
  // max_spin: the wait for an answer spins this long before it sleeps (transport/doorbell.h).
  ClientStepChannel(v1::MoeService::Stub* stub, std::string token, uint64_t ring_bytes,
                    absl::Duration max_spin = absl::ZeroDuration())
      : stub_(stub), token_(std::move(token)), ring_bytes_(ring_bytes), max_spin_(max_spin) {}

  // The answer's bytes of a step record (`body`: the request as the gRPC call sends it; an
  // error: the status moed answered, as the gRPC call returns it), or nullopt when the step is
  // to go over gRPC: off, busy, `body` or `answer_bytes` larger than half a ring, or the
  // channel failed just now.
  std::optional<absl::StatusOr<std::string>> Call(StepKind kind, absl::string_view body,
                                                  size_t answer_bytes, absl::Duration timeout);
  bool on() const { return !off_.load(std::memory_order_acquire); }
  // Whether a request of `request_bytes` and an answer of `answer_bytes` may use the ring.
  bool Fits(size_t request_bytes, size_t answer_bytes) const {
    return on() && request_bytes + 64 <= ring_bytes_ / 2 && answer_bytes + 4096 <= ring_bytes_ / 2;
  }
  uint64_t steps() const { return steps_.load(std::memory_order_relaxed); }

 private:
  // Opens the channel (nullptr when moed refused it: then off).
  RingChannel* Open() ABSL_EXCLUSIVE_LOCKS_REQUIRED(busy_);
  void TurnOff(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(busy_);

  v1::MoeService::Stub* const stub_;
  const std::string token_;
  const uint64_t ring_bytes_;
  const absl::Duration max_spin_;
  absl::Mutex busy_;  // one step on the ring at a time (TryLock: others take gRPC)
  std::unique_ptr<RingChannel> ring_ ABSL_GUARDED_BY(busy_);
  std::atomic<bool> off_{false};
  std::atomic<uint64_t> steps_{0};
};

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_STEP_CHANNEL_H_
