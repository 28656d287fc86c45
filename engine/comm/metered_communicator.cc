#include "engine/comm/metered_communicator.h"

#include "absl/time/clock.h"

namespace moe {

CommTraffic MeteredCommunicator::traffic() const {
  CommTraffic t;
  t.all_to_all_calls = calls_.load(std::memory_order_relaxed);
  t.all_to_all_bytes_sent = bytes_sent_.load(std::memory_order_relaxed);
  t.all_to_all_bytes_received = bytes_received_.load(std::memory_order_relaxed);
  t.all_to_all_time = absl::Nanoseconds(nanos_.load(std::memory_order_relaxed));
  return t;
}

absl::Status MeteredCommunicator::AllToAllV(const void* send, absl::Span<const size_t> send_bytes,
                                            void* recv, absl::Span<const size_t> recv_bytes) {
  const int me = rank();
  int64_t sent = 0;
  int64_t received = 0;
  for (size_t r = 0; r < send_bytes.size(); ++r) {
    if (static_cast<int>(r) != me) sent += static_cast<int64_t>(send_bytes[r]);
  }
  for (size_t r = 0; r < recv_bytes.size(); ++r) {
    if (static_cast<int>(r) != me) received += static_cast<int64_t>(recv_bytes[r]);
  }
  const absl::Time start = absl::Now();
  absl::Status status = inner_->AllToAllV(send, send_bytes, recv, recv_bytes);
  nanos_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start), std::memory_order_relaxed);
  calls_.fetch_add(1, std::memory_order_relaxed);
  bytes_sent_.fetch_add(sent, std::memory_order_relaxed);
  bytes_received_.fetch_add(received, std::memory_order_relaxed);
  return status;
}

}  // namespace moe
