// RingChannel: a request/response channel between two processes on one host, made of two
// StepRings (request: caller -> server, response: server -> caller) in one shared region
// (ring_layout.h; transport/README.md). A call costs two records and two futex doorbells
// instead of a gRPC round trip: the fast path of a step between a caller, moed and the
// workers on the same host (issue 37 §2). Setup, other hosts and fallback stay gRPC.
//
//   // server (e.g. moed): creates the region and hands its name to the caller
//   ASSIGN_OR_RETURN(ShmObject object, ShmObject::CreateNamed(name, RingChannel::RegionBytes(1 <<
//   20))); ASSIGN_OR_RETURN(auto channel, RingChannel::Create(std::move(object),
//   RingChannel::Role::kServer)); RETURN_IF_ERROR(channel->Serve([](absl::string_view request) {
//   return Step(request); }));
//
//   // caller
//   ASSIGN_OR_RETURN(ShmObject object, ShmObject::OpenNamed(name));
//   ASSIGN_OR_RETURN(auto channel, RingChannel::Attach(std::move(object),
//   RingChannel::Role::kCaller)); ASSIGN_OR_RETURN(std::string response, channel->Call(request,
//   absl::Now() + absl::Seconds(1)));
//
// Failure model (every case has a test in tests/transport/): the peer's pid is in the header;
// a side blocked on the other checks every options.peer_check_interval whether that process
// still lives, so a killed server makes Call() UNAVAILABLE within its deadline (at most one
// interval late) and a killed caller makes Serve() return UNAVAILABLE within one interval. A
// closing side sets its `closed` flag and rings (Serve returns OK, Call UNAVAILABLE at once).
// Anything the peer writes that an honest peer never does fails the channel with DATA_LOSS.
// Both processes must share a pid namespace (the pids in the header are compared by kill(2)).
#ifndef MOED_TRANSPORT_RING_CHANNEL_H_
#define MOED_TRANSPORT_RING_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/ring_layout.h"
#include "transport/shm_object.h"
#include "transport/step_ring.h"

namespace moe {

struct RingChannelOptions {
  uint64_t ring_bytes = uint64_t{1} << 20;  // Create only: each ring's data bytes, power of two
  absl::Duration peer_check_interval = absl::Milliseconds(20);
  absl::Duration max_spin = absl::ZeroDuration();     // Doorbell spin limit (docs/DECISIONS.md)
  absl::Duration attach_timeout = absl::Seconds(10);  // Serve: how long to wait for a caller
};

class RingChannel {
 public:
  enum class Role { kCaller, kServer };
  using Handler = std::function<absl::StatusOr<std::string>(absl::string_view request)>;

  // Bytes of the region for rings of `ring_bytes` each.
  static uint64_t RegionBytes(uint64_t ring_bytes) {
    return ring_layout::kDataOffset + 2 * ring_bytes;
  }

  // Lays a new channel out in `object` (size RegionBytes(options.ring_bytes), else
  // INVALID_ARGUMENT) and takes `role` in it.
  static absl::StatusOr<std::unique_ptr<RingChannel>> Create(
      ShmObject object, Role role, const RingChannelOptions& options = {});
  // Joins a channel another process created, in the other role. INVALID_ARGUMENT when the
  // region is not a channel (magic, version, sizes), FAILED_PRECONDITION when `role` is taken.
  static absl::StatusOr<std::unique_ptr<RingChannel>> Attach(
      ShmObject object, Role role, const RingChannelOptions& options = {});

  // Marks this side closed and rings the peer.
  ~RingChannel();

  // Caller: sends `request` and returns the server's response (or the handler's error status)
  // by `deadline`. DEADLINE_EXCEEDED when the server has not answered by then (its late answer
  // is skipped by the next call), RESOURCE_EXHAUSTED when the request ring stays full,
  // UNAVAILABLE when the server closed or died, DATA_LOSS when the channel is corrupt.
  // Thread-safe (calls are serialized: one in flight per channel). *answered (if given): true
  // when the result is the server's answer (its response or its handler's status), false when
  // the channel itself failed (the call may not have reached the handler).
  absl::StatusOr<std::string> Call(absl::string_view request, absl::Time deadline,
                                   bool* answered = nullptr);
  // The same, also ended with CANCELLED once `cancelled()` returns true (polled every
  // options.peer_check_interval while the call waits; e.g. moed giving up on a generation's
  // calls). As after a DEADLINE_EXCEEDED, the next call skips the late answer.
  absl::StatusOr<std::string> Call(absl::string_view request, absl::Time deadline,
                                   const std::function<bool()>& cancelled,
                                   bool* answered = nullptr);

  // The largest request (caller) or response (server) one record can carry.
  uint64_t max_payload() const { return outgoing_->max_payload(); }

  // Server: answers requests with `handler` until the caller closes the channel or Stop() is
  // called (OK), the caller dies or does not attach within options.attach_timeout (UNAVAILABLE), or
  // the channel is corrupt (DATA_LOSS). The handler sees a private copy of each request.
  absl::Status Serve(const Handler& handler);
  // OK once the peer has attached (e.g. to Unlink() the name then), UNAVAILABLE at `deadline`.
  absl::Status WaitForPeer(absl::Time deadline);

  // Makes Serve() return OK within one peer_check_interval; any thread.
  void Stop();

  // The peer's pid as the header holds it (0 until it attached); any thread.
  uint32_t PeerPid() const;
  // False once the peer attached and then closed its side or exited (kill(2) and /proc, as
  // the wait's check); true before it attached. Any thread.
  bool PeerAlive() const;

  Role role() const { return role_; }
  const std::string& name() const { return object_.name(); }
  ShmObject& object() { return object_; }  // e.g. to Unlink() once the peer attached

 private:
  RingChannel(ShmObject object, ShmMapping mapping, Role role, const RingChannelOptions& options);
  ring_layout::RegionHeader* header() const {
    return reinterpret_cast<ring_layout::RegionHeader*>(mapping_.data());
  }
  static absl::StatusOr<std::unique_ptr<RingChannel>> Join(ShmObject object, ShmMapping mapping,
                                                           Role role,
                                                           const RingChannelOptions& options);
  // OK while the peer is attached and open (or not yet attached); else why not.
  absl::Status CheckPeer(bool timed_out);
  RingWait MakeWait(absl::Time deadline, const std::function<bool()>* cancelled = nullptr);

  ShmObject object_;
  ShmMapping mapping_;
  const Role role_;
  const RingChannelOptions options_;
  std::unique_ptr<StepRing> outgoing_;  // caller: requests; server: responses
  std::unique_ptr<StepRing> incoming_;
  uint32_t peer_pid_ = 0;  // once read nonzero from the header, kept (the peer cannot move it)
  std::atomic<bool> stop_{false};

  absl::Mutex call_mu_;
  uint64_t next_sequence_ ABSL_GUARDED_BY(call_mu_) = 1;
};

}  // namespace moe

#endif  // MOED_TRANSPORT_RING_CHANNEL_H_
