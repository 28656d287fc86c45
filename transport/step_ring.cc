#include "transport/step_ring.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe {

using ring_layout::kRecordAlign;
using ring_layout::RecordBytes;
using ring_layout::RecordHeader;

StepRing::StepRing(ring_layout::RingControl* control, char* data, uint64_t ring_bytes, Side side,
                   absl::Duration max_spin)
    : control_(control),
      data_(data),
      ring_bytes_(ring_bytes),
      side_(side),
      data_bell_(&control->data_bell, max_spin),
      space_bell_(&control->space_bell, max_spin) {}

absl::Status StepRing::Init() {
  const uint64_t head = control_->head.load(std::memory_order_acquire);
  const uint64_t tail = control_->tail.load(std::memory_order_acquire);
  if (head < tail || head - tail > ring_bytes_ || head % kRecordAlign != 0 ||
      tail % kRecordAlign != 0) {
    return Fail(absl::StrCat("head ", head, " and tail ", tail, " are not a ring of ", ring_bytes_,
                             " bytes"));
  }
  head_ = head;
  tail_ = tail;
  return absl::OkStatus();
}

void StepRing::RingPeer() {
  if (side_ == Side::kProducer) {
    data_bell_.Ring();
  } else {
    space_bell_.Ring();
  }
}

absl::Status StepRing::Fail(std::string message) {
  if (broken_.ok()) {
    broken_ = absl::DataLossError(absl::StrCat("step ring corrupt: ", message));
  }
  return broken_;
}

// The consumer may only move tail forward, up to what was published.
absl::StatusOr<uint64_t> StepRing::PeerTail() {
  const uint64_t tail = control_->tail.load(std::memory_order_acquire);
  if (tail < tail_ || tail > head_ || tail % kRecordAlign != 0) {
    return Fail(absl::StrCat("tail ", tail, " outside [", tail_, ", ", head_, "]"));
  }
  tail_ = tail;
  return tail;
}

// The producer may only move head forward, at most one ring ahead of what was consumed.
absl::StatusOr<uint64_t> StepRing::PeerHead() {
  const uint64_t head = control_->head.load(std::memory_order_acquire);
  if (head < head_ || head - tail_ > ring_bytes_ || head % kRecordAlign != 0) {
    return Fail(absl::StrCat("head ", head, " outside [", head_, ", ", tail_ + ring_bytes_, "]"));
  }
  head_ = head;
  return head;
}

absl::Status StepRing::WaitOnce(Doorbell& bell, uint32_t seen, const RingWait& wait) {
  const absl::Time now = absl::Now();
  if (now >= wait.deadline) return absl::DeadlineExceededError("deadline");
  const absl::Time until = std::min(wait.deadline, now + wait.check_interval);
  const bool timed_out = absl::IsDeadlineExceeded(bell.Wait(seen, until));
  if (wait.check) return wait.check(timed_out);
  return absl::OkStatus();
}

void StepRing::CopyIn(uint64_t position, const void* bytes, uint64_t n) {
  const uint64_t offset = position & (ring_bytes_ - 1);
  const uint64_t first = std::min(n, ring_bytes_ - offset);
  std::memcpy(data_ + offset, bytes, first);
  std::memcpy(data_, static_cast<const char*>(bytes) + first, n - first);
}

void StepRing::CopyOut(uint64_t position, void* bytes, uint64_t n) const {
  const uint64_t offset = position & (ring_bytes_ - 1);
  const uint64_t first = std::min(n, ring_bytes_ - offset);
  std::memcpy(bytes, data_ + offset, first);
  std::memcpy(static_cast<char*>(bytes) + first, data_, n - first);
}

absl::Status StepRing::Push(uint64_t sequence, uint32_t status_code, absl::string_view payload,
                            const RingWait& wait) {
  if (side_ != Side::kProducer) return absl::InternalError("Push on the consumer side");
  if (!broken_.ok()) return broken_;
  if (payload.size() > max_payload()) {
    return absl::InvalidArgumentError(absl::StrCat("a record of ", payload.size(),
                                                   " bytes never fits a ring of ", ring_bytes_,
                                                   " bytes (at most ", max_payload(), ")"));
  }
  const uint64_t need = RecordBytes(payload.size());
  for (;;) {
    const uint32_t seen = space_bell_.Value();
    absl::StatusOr<uint64_t> tail = PeerTail();
    if (!tail.ok()) return tail.status();
    if (ring_bytes_ - (head_ - *tail) >= need) break;
    absl::Status s = WaitOnce(space_bell_, seen, wait);
    if (absl::IsDeadlineExceeded(s)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("step ring full: no room for ", need, " bytes (", head_ - tail_, " of ",
                       ring_bytes_, " in use) before the deadline"));
    }
    if (!s.ok()) return s;
  }
  RecordHeader header{static_cast<uint32_t>(payload.size()), status_code, sequence};
  CopyIn(head_, &header, sizeof(header));  // aligned: never wraps
  CopyIn(head_ + sizeof(header), payload.data(), payload.size());
  head_ += need;
  control_->head.store(head_, std::memory_order_release);  // publishes the whole record
  data_bell_.Ring();
  return absl::OkStatus();
}

absl::StatusOr<StepRing::Record> StepRing::Pop(const RingWait& wait) {
  if (side_ != Side::kConsumer) return absl::InternalError("Pop on the producer side");
  if (!broken_.ok()) return broken_;
  for (;;) {
    const uint32_t seen = data_bell_.Value();
    absl::StatusOr<uint64_t> head = PeerHead();
    if (!head.ok()) return head.status();
    if (*head != tail_) break;
    absl::Status s = WaitOnce(data_bell_, seen, wait);
    if (absl::IsDeadlineExceeded(s)) {
      return absl::DeadlineExceededError("no record before the deadline");
    }
    if (!s.ok()) return s;
  }
  const uint64_t available = head_ - tail_;
  RecordHeader header;
  CopyOut(tail_, &header, sizeof(header));  // a private copy: the peer cannot change it now
  const uint64_t need = RecordBytes(header.payload_bytes);
  if (header.payload_bytes > max_payload() || need > available) {
    return Fail(absl::StrCat("a record of ", header.payload_bytes, " bytes with ", available,
                             " bytes published"));
  }
  Record record;
  record.sequence = header.sequence;
  record.status_code = header.status_code;
  record.payload.resize(header.payload_bytes);
  CopyOut(tail_ + sizeof(header), record.payload.data(), header.payload_bytes);
  tail_ += need;
  control_->tail.store(tail_, std::memory_order_release);  // the bytes may be reused now
  space_bell_.Ring();
  return record;
}

}  // namespace moe
