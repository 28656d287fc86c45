// The envelope of a step record on a RingChannel (transport/README.md "Phase 2", item 3):
// 8 bytes before the request's own bytes, so one channel carries several kinds of call with
// their deadlines. Knows nothing of protos: `kind` is the user's number.
//
//   offset size
//   0      1    kind         1..255 (0 is never a kind)
//   1      3    zero
//   4      4    deadline_ms  little-endian, 1 to 2^31-1: the call's remaining deadline
//   8      n    body         e.g. a serialized ForwardRequest
//
//   std::string record = EncodeStepEnvelope(1, absl::Milliseconds(500), body);
//   ASSIGN_OR_RETURN(StepEnvelope e, DecodeStepEnvelope(record));   // e.body views `record`
//
// The Python twin is client/python/moe_client/step_channel.py.
#ifndef MOED_TRANSPORT_STEP_ENVELOPE_H_
#define MOED_TRANSPORT_STEP_ENVELOPE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace moe {

inline constexpr size_t kStepEnvelopeBytes = 8;
inline constexpr uint32_t kMaxStepDeadlineMs = 0x7FFFFFFF;

struct StepEnvelope {
  uint8_t kind = 0;
  absl::Duration deadline;  // remaining when the caller sent it, > 0
  absl::string_view body;   // views the decoded record
};

// `deadline` is clamped to [1 ms, kMaxStepDeadlineMs ms] (a past deadline still reaches the
// server, which then answers DEADLINE_EXCEEDED as gRPC would).
std::string EncodeStepEnvelope(uint8_t kind, absl::Duration deadline, absl::string_view body);
// INVALID_ARGUMENT naming what is wrong: fewer than 8 bytes, kind 0, nonzero padding, a
// deadline of 0 or above kMaxStepDeadlineMs.
absl::StatusOr<StepEnvelope> DecodeStepEnvelope(absl::string_view record);

}  // namespace moe

#endif  // MOED_TRANSPORT_STEP_ENVELOPE_H_
