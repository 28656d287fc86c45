// A Communicator that counts what its AllToAllV calls move between ranks and how long they take,
// around any other Communicator (Gloo, NCCL, local). The worker reads the totals before and after
// a layer's step to report that step's all-to-all traffic (moed_worker_all_to_all_* metrics).
//
//   auto comm = std::make_unique<MeteredCommunicator>(std::move(gloo));
//   const CommTraffic before = comm->traffic();
//   ... layer->Forward(...) ...                     // dispatch and combine call AllToAllV
//   const CommTraffic step = comm->traffic() - before;
//
// Bytes are those sent to and received from the other ranks (a rank's own slice is a local copy,
// not traffic). Time is the wall time of the AllToAllV calls on the calling thread: with Gloo the
// whole exchange; with NCCL only the enqueue (the transfer runs on the stream, inside the
// engine's time).
#ifndef MOED_ENGINE_COMM_METERED_COMMUNICATOR_H_
#define MOED_ENGINE_COMM_METERED_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/comm/communicator.h"

namespace moe {

struct CommTraffic {
  int64_t all_to_all_calls = 0;
  int64_t all_to_all_bytes_sent = 0;      // to the other ranks
  int64_t all_to_all_bytes_received = 0;  // from the other ranks
  absl::Duration all_to_all_time;

  CommTraffic operator-(const CommTraffic& earlier) const {
    return CommTraffic{all_to_all_calls - earlier.all_to_all_calls,
                       all_to_all_bytes_sent - earlier.all_to_all_bytes_sent,
                       all_to_all_bytes_received - earlier.all_to_all_bytes_received,
                       all_to_all_time - earlier.all_to_all_time};
  }
};

class MeteredCommunicator final : public Communicator {
 public:
  explicit MeteredCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}

  // Totals since construction, failed calls included (their bytes as asked). Thread-safe.
  CommTraffic traffic() const;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  MemorySpace memory_space() const override { return inner_->memory_space(); }
  std::string name() const override { return inner_->name(); }
  absl::Status AllReduceSum(void* data, size_t count, DType dtype) override {
    return inner_->AllReduceSum(data, count, dtype);
  }
  absl::Status AllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    return inner_->AllGather(send, recv, bytes_per_rank);
  }
  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_bytes, void* recv,
                         absl::Span<const size_t> recv_bytes) override;
  absl::Status Barrier() override { return inner_->Barrier(); }

 private:
  const std::unique_ptr<Communicator> inner_;
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> bytes_sent_{0};
  std::atomic<int64_t> bytes_received_{0};
  std::atomic<int64_t> nanos_{0};
};

}  // namespace moe

#endif  // MOED_ENGINE_COMM_METERED_COMMUNICATOR_H_
