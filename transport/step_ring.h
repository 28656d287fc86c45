// StepRing: one direction of a RingChannel, a single-producer/single-consumer ring of
// variable-length records in shared memory (layout: ring_layout.h). This process is either
// the producer or the consumer of the ring; the peer process is the other one, and may be
// killed at any instant or write any bytes anywhere in the region.
//
// Guarantees, whatever the peer does:
// - A record is published by a release-store of head after its bytes are written, so a
//   consumer never sees a half-written record (a producer killed mid-record publishes nothing).
// - Every index and length read from shared memory is bounds-checked, and a payload is copied
//   out before anyone looks at it; a value no honest peer writes fails the ring for good with
//   DATA_LOSS (the same status from then on), never an out-of-bounds access.
//
//   StepRing ring(control, data, ring_bytes, StepRing::Side::kProducer);
//   RETURN_IF_ERROR(ring.Init());
//   RETURN_IF_ERROR(ring.Push(/*sequence=*/7, /*status_code=*/0, bytes, wait));
//
// Not thread-safe: one thread per side (RingChannel serializes its callers).
#ifndef MOED_TRANSPORT_STEP_RING_H_
#define MOED_TRANSPORT_STEP_RING_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/doorbell.h"
#include "transport/ring_layout.h"

namespace moe {

// How long and how a blocked Push/Pop waits. Every `check_interval` without a ring, and after
// every ring that did not satisfy the wait, `check(timed_out)` runs; a non-OK status from it
// ends the wait with that status (a closed channel, a dead peer).
struct RingWait {
  absl::Time deadline = absl::InfiniteFuture();
  absl::Duration check_interval = absl::Milliseconds(20);
  std::function<absl::Status(bool timed_out)> check;
};

class StepRing {
 public:
  enum class Side { kProducer, kConsumer };
  struct Record {
    uint64_t sequence = 0;
    uint32_t status_code = 0;
    std::string payload;  // a private copy
  };

  // `control` and `data` (ring_bytes bytes, a power of two) lie in a mapping that outlives
  // the ring. Call Init() before anything else.
  StepRing(ring_layout::RingControl* control, char* data, uint64_t ring_bytes, Side side,
           absl::Duration max_spin = absl::ZeroDuration());

  // Reads head and tail once (a ring attached to after traffic started) and checks them.
  absl::Status Init();

  // The largest payload one record can carry.
  uint64_t max_payload() const { return ring_bytes_ - sizeof(ring_layout::RecordHeader); }

  // Producer. Waits for room until wait.deadline: RESOURCE_EXHAUSTED then. A payload larger
  // than max_payload() is INVALID_ARGUMENT at once.
  absl::Status Push(uint64_t sequence, uint32_t status_code, absl::string_view payload,
                    const RingWait& wait);
  // Consumer. Waits for a record until wait.deadline: DEADLINE_EXCEEDED then.
  absl::StatusOr<Record> Pop(const RingWait& wait);

  // Rings the bell this side owns (producer: data, consumer: space), e.g. to make the peer
  // look at a flag it checks when woken.
  void RingPeer();

  // The first corruption found (OK while none).
  const absl::Status& broken() const { return broken_; }

 private:
  // Validated views of the peer's counter; on a bad value they fail the ring.
  absl::StatusOr<uint64_t> PeerTail();
  absl::StatusOr<uint64_t> PeerHead();
  absl::Status Fail(std::string message);
  // One bounded sleep on `bell` (seen: its value before the condition was checked).
  absl::Status WaitOnce(Doorbell& bell, uint32_t seen, const RingWait& wait);
  void CopyIn(uint64_t position, const void* bytes, uint64_t n);
  void CopyOut(uint64_t position, void* bytes, uint64_t n) const;

  ring_layout::RingControl* const control_;
  char* const data_;
  const uint64_t ring_bytes_;
  const Side side_;
  Doorbell data_bell_;
  Doorbell space_bell_;
  uint64_t head_ = 0;  // producer: what it published; consumer: the last head it accepted
  uint64_t tail_ = 0;  // consumer: what it consumed; producer: the last tail it accepted
  absl::Status broken_;
};

}  // namespace moe

#endif  // MOED_TRANSPORT_STEP_RING_H_
