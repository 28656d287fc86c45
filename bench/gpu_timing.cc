#include "bench/gpu_timing.h"

#include <cuda_runtime.h>

namespace moe {
namespace bench {

EventLog::~EventLog() {
  for (TimedOp& op : ops_) {
    cudaEventDestroy(static_cast<cudaEvent_t>(op.start));
    cudaEventDestroy(static_cast<cudaEvent_t>(op.stop));
  }
}

void EventLog::Begin(size_t bytes, const char* name) {
  if (used_ == ops_.size()) {
    TimedOp op;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    op.start = a, op.stop = b;
    ops_.push_back(op);
  }
  ops_[used_].bytes = bytes;
  ops_[used_].name = name;
  cudaEventRecord(static_cast<cudaEvent_t>(ops_[used_].start), static_cast<cudaStream_t>(stream_));
}

void EventLog::End() {
  cudaEventRecord(static_cast<cudaEvent_t>(ops_[used_].stop), static_cast<cudaStream_t>(stream_));
  ++used_;
}

double EventLog::TotalMs(size_t* bytes) const {
  double total = 0;
  size_t b = 0;
  for (size_t i = 0; i < used_; ++i) {
    cudaEventSynchronize(static_cast<cudaEvent_t>(ops_[i].stop));
    float ms = 0;
    cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(ops_[i].start),
                         static_cast<cudaEvent_t>(ops_[i].stop));
    total += ms;
    b += ops_[i].bytes;
  }
  if (bytes != nullptr) *bytes = b;
  return total;
}

double EventLog::SpanMs() const {
  if (used_ == 0) return 0;
  cudaEventSynchronize(static_cast<cudaEvent_t>(ops_[used_ - 1].stop));
  float ms = 0;
  cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(ops_[0].start),
                       static_cast<cudaEvent_t>(ops_[used_ - 1].stop));
  return ms;
}

void EventLog::AddByName(std::map<std::string, double>* by_name) const {
  for (size_t i = 0; i < used_; ++i) {
    cudaEventSynchronize(static_cast<cudaEvent_t>(ops_[i].stop));
    float ms = 0;
    cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(ops_[i].start),
                         static_cast<cudaEvent_t>(ops_[i].stop));
    (*by_name)[ops_[i].name] += ms;
  }
}

absl::Status TimingBackend::CopyFromHost(void* dst, const void* src, size_t bytes) {
  copies_.Begin(bytes, "CopyFromHost");
  absl::Status s = inner_->CopyFromHost(dst, src, bytes);
  copies_.End();
  return s;
}

absl::Status TimingBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
  // The start event completes when the work before the copy is done, the stop after the copy
  // (CopyToHost waits for it): their difference is the copy alone.
  copies_.Begin(bytes, "CopyToHost");
  absl::Status s = inner_->CopyToHost(dst, src, bytes);
  copies_.End();
  return s;
}

absl::Status TimingCommunicator::AllToAllV(const void* send, absl::Span<const size_t> send_bytes,
                                           void* recv, absl::Span<const size_t> recv_bytes) {
  size_t total = 0;
  for (size_t b : send_bytes) total += b;
  exchanges_.Begin(total, "AllToAllV");
  absl::Status s = inner_->AllToAllV(send, send_bytes, recv, recv_bytes);
  exchanges_.End();
  return s;
}

}  // namespace bench
}  // namespace moe
