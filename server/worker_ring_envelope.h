// The envelope of a call sent as a RingChannel record (transport/ring_channel.h): 8 bytes
// before the call's serialized request, so that one channel carries several kinds of call
// with their deadlines, as gRPC carries a method name and a grpc-timeout. Generic: a kind
// byte, a deadline, bytes; what the kinds mean is the user's (moed -> worker: WorkerRingKind
// in server/worker_rings.h).
//
//   +0  u8   kind               nonzero
//   +1  u8x3 zero
//   +4  u32  remaining deadline milliseconds when sent (little-endian; at least 1)
//   +8  ...  body (e.g. a serialized WorkerForwardRequest, exactly the gRPC request's bytes)
//
// Like gRPC's timeout header the deadline is relative: the receiver's deadline is its own
// clock at receipt plus that many milliseconds (the two processes share a host clock anyway).
//
//   std::string record = WrapEnvelope(kind, deadline, body);
//   ASSIGN_OR_RETURN(Envelope envelope, UnwrapEnvelope(record));  // the receiver
#ifndef MOED_SERVER_WORKER_RING_ENVELOPE_H_
#define MOED_SERVER_WORKER_RING_ENVELOPE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace moe {

inline constexpr size_t kEnvelopeBytes = 8;

struct Envelope {
  uint8_t kind = 0;
  absl::Time deadline;     // receipt + the remaining milliseconds
  absl::string_view body;  // a view into the record
};

// The record of `body` sent as `kind` with `deadline` (remaining time clamped to [1 ms, 2^32 ms)).
std::string WrapEnvelope(uint8_t kind, absl::Time deadline, absl::string_view body);
// Splits a received record. INVALID_ARGUMENT when shorter than the envelope, or kind 0 or
// reserved bytes nonzero (no honest sender writes those).
absl::StatusOr<Envelope> UnwrapEnvelope(absl::string_view record);

// This process's pid namespace ("pid:[4026531836]", readlink /proc/self/ns/pid; empty when
// unknown). Two ends of a ring compare theirs: the pids in a channel's header only mean the
// same processes to both when it is the same.
std::string PidNamespace();

}  // namespace moe

#endif  // MOED_SERVER_WORKER_RING_ENVELOPE_H_
