// Measuring decorators for the GPU benchmark: a Backend and a Communicator that forward every
// call to the real ones and, with CUDA events on the backend's stream, time the host<->device
// copies (CopyFromHost/CopyToHost) and the all-to-all exchanges (AllToAllV) a layer step makes.
// The benchmark subtracts the copies to report device-resident step times next to the
// host-tensor API times, and divides the exchanged bytes by the exchange time for the
// dispatch/combine bandwidth.
//
//   TimingBackend tb(cuda.get());
//   TimingCommunicator tc(nccl.get(), cuda->stream());
//   ... layer on &tb, &tc; step ...
//   StepTimes t = CollectTimes(tb, tc);  // after the step (the stream is synchronised)
#ifndef MOED_BENCH_GPU_TIMING_H_
#define MOED_BENCH_GPU_TIMING_H_

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/comm/communicator.h"

namespace moe {
namespace bench {

// A pair of CUDA events around one operation, with its name and the bytes it moved.
struct TimedOp {
  void* start = nullptr;  // cudaEvent_t
  void* stop = nullptr;
  size_t bytes = 0;
  const char* name = "";
};

// Recycles events: Begin() hands out a recorded start, End() records the stop.
class EventLog {
 public:
  explicit EventLog(void* stream) : stream_(stream) {}
  ~EventLog();
  void Begin(size_t bytes, const char* name = "");
  void End();
  // Sum of the elapsed milliseconds and bytes of the ops since the last Reset (synchronises).
  double TotalMs(size_t* bytes = nullptr) const;
  // Milliseconds from the first op's start to the last op's stop (gaps included).
  double SpanMs() const;
  // Adds each op's milliseconds to (*by_name)[its name] (synchronises).
  void AddByName(std::map<std::string, double>* by_name) const;
  void Reset() { used_ = 0; }
  size_t count() const { return used_; }

 private:
  void* stream_;
  std::vector<TimedOp> ops_;
  size_t used_ = 0;
};

class TimingBackend : public Backend {
 public:
  explicit TimingBackend(Backend* inner)
      : inner_(inner), copies_(inner->stream()), ops_(inner->stream()) {}
  EventLog& copies() { return copies_; }
  EventLog& ops() { return ops_; }  // every device operation except the host copies

  std::string name() const override { return inner_->name(); }
  MemorySpace memory_space() const override { return inner_->memory_space(); }
  void* stream() const override { return inner_->stream(); }
  absl::StatusOr<Buffer> Allocate(size_t bytes) override { return inner_->Allocate(bytes); }
  absl::Status CopyFromHost(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override;
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    return Timed(&ops_, "Copy", [&] { return inner_->Copy(dst, src, bytes); });
  }
  absl::Status Memset(void* dst, int value, size_t bytes) override {
    return Timed(&ops_, "Memset", [&] { return inner_->Memset(dst, value, bytes); });
  }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  size_t allocated_bytes() const override { return inner_->allocated_bytes(); }
  size_t peak_allocated_bytes() const override { return inner_->peak_allocated_bytes(); }
  bool GemmReadsBf16A() const override { return inner_->GemmReadsBf16A(); }
  // The layer's AUTO FP8 choice is the real backend's (its table), not Backend's default.
  bool Fp8GemmPays(const Fp8GemmShape& s) const override { return inner_->Fp8GemmPays(s); }
  absl::Status AllFinite(const float* data, int64_t count, bool* all_finite) override {
    return inner_->AllFinite(data, count, all_finite);
  }
  absl::Status Gemm(const GemmArgs& a) override {
    return Timed(&ops_, "Gemm", [&] { return inner_->Gemm(a); });
  }
  absl::Status GroupedGemm(absl::Span<const GemmArgs> g) override {
    return Timed(&ops_, "GroupedGemm", [&] { return inner_->GroupedGemm(g); });
  }
  absl::Status CheckComputeDType(const LayerConfig& c) const override {
    return inner_->CheckComputeDType(c);
  }
  absl::Status QuantizeFp8(const QuantizeArgs& q) override {
    return Timed(&ops_, "QuantizeFp8", [&] { return inner_->QuantizeFp8(q); });
  }
  absl::Status Fp8HistoryAmax(const Fp8HistoryArgs& h) override {
    return Timed(&ops_, "Fp8HistoryAmax", [&] { return inner_->Fp8HistoryAmax(h); });
  }
  absl::Status Convert(const void* s, DType st, void* d, DType dt, int64_t n) override {
    return Timed(&ops_, "Convert", [&] { return inner_->Convert(s, st, d, dt, n); });
  }
  absl::Status AddInPlace(float* d, const float* s, int64_t n) override {
    return Timed(&ops_, "AddInPlace", [&] { return inner_->AddInPlace(d, s, n); });
  }
  absl::Status RouterForward(const RouterForwardArgs& a) override {
    return Timed(&ops_, "RouterForward", [&] { return inner_->RouterForward(a); });
  }
  absl::Status RouterBackward(const RouterBackwardArgs& a) override {
    return Timed(&ops_, "RouterBackward", [&] { return inner_->RouterBackward(a); });
  }
  absl::Status RoutePlan(const RoutePlanArgs& a) override {
    return Timed(&ops_, "RoutePlan", [&] { return inner_->RoutePlan(a); });
  }
  absl::Status Permute(const PermuteArgs& a) override {
    return Timed(&ops_, "Permute", [&] { return inner_->Permute(a); });
  }
  absl::Status GatherRows(const void* s, const int32_t* i, int64_t r, int64_t w, DType t,
                          void* d) override {
    return Timed(&ops_, "GatherRows", [&] { return inner_->GatherRows(s, i, r, w, t, d); });
  }
  absl::Status ScatterTokenRows(const void* s, const int32_t* pr, int64_t t, int64_t k,
                                const int32_t* rt, int64_t r, int64_t w, DType dt,
                                void* d) override {
    return Timed(&ops_, "ScatterTokenRows",
                 [&] { return inner_->ScatterTokenRows(s, pr, t, k, rt, r, w, dt, d); });
  }
  absl::Status CopyRowBlocks(const void* s, void* d, size_t rb,
                             absl::Span<const RowBlock> b) override {
    return Timed(&ops_, "CopyRowBlocks", [&] { return inner_->CopyRowBlocks(s, d, rb, b); });
  }
  absl::Status CombineRows(const void* y, DType yt, const int32_t* pr, const float* w, int64_t t,
                           int64_t k, int64_t wd, void* o, DType ot) override {
    return Timed(&ops_, "CombineRows",
                 [&] { return inner_->CombineRows(y, yt, pr, w, t, k, wd, o, ot); });
  }
  absl::Status CombineBackward(const void* d, DType dt, const void* y, DType yt, const int32_t* pr,
                               const float* w, int64_t t, int64_t k, int64_t wd, int64_t rows,
                               void* dy, float* dw) override {
    return Timed(&ops_, "CombineBackward", [&] {
      return inner_->CombineBackward(d, dt, y, yt, pr, w, t, k, wd, rows, dy, dw);
    });
  }
  absl::Status ActivationForward(const ActivationArgs& a) override {
    return Timed(&ops_, "ActivationForward", [&] { return inner_->ActivationForward(a); });
  }
  absl::Status ActivationBackward(const ActivationArgs& a) override {
    return Timed(&ops_, "ActivationBackward", [&] { return inner_->ActivationBackward(a); });
  }
  absl::Status AddGroupBias(void* y, DType t, const float* b, int64_t w, GroupRows g) override {
    return Timed(&ops_, "AddGroupBias", [&] { return inner_->AddGroupBias(y, t, b, w, g); });
  }
  absl::Status GroupBiasGrad(const void* d, DType t, int64_t w, GroupRows g, float* db) override {
    return Timed(&ops_, "GroupBiasGrad", [&] { return inner_->GroupBiasGrad(d, t, w, g, db); });
  }
  absl::Status OptimizerStep(const OptimizerArgs& a, float* p, const float* g, float* s1, float* s2,
                             int64_t n) override {
    return Timed(&ops_, "OptimizerStep", [&] { return inner_->OptimizerStep(a, p, g, s1, s2, n); });
  }

 private:
  template <typename Fn>
  absl::Status Timed(EventLog* log, const char* name, const Fn& fn) {
    log->Begin(0, name);
    absl::Status s = fn();
    log->End();
    return s;
  }
  Backend* inner_;
  EventLog copies_;
  EventLog ops_;
};

class TimingCommunicator : public Communicator {
 public:
  TimingCommunicator(Communicator* inner, void* stream)
      : inner_(inner), exchanges_(stream), others_(stream) {}
  EventLog& exchanges() { return exchanges_; }  // AllToAllV
  EventLog& others() { return others_; }        // AllReduceSum, AllGather

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  MemorySpace memory_space() const override { return inner_->memory_space(); }
  std::string name() const override { return inner_->name(); }
  absl::Status AllReduceSum(void* d, size_t n, DType t) override {
    others_.Begin(n * DTypeSize(t), "AllReduceSum");
    absl::Status s = inner_->AllReduceSum(d, n, t);
    others_.End();
    return s;
  }
  absl::Status AllGather(const void* s, void* r, size_t b) override {
    others_.Begin(b, "AllGather");
    absl::Status st = inner_->AllGather(s, r, b);
    others_.End();
    return st;
  }
  // Bytes counted: everything this rank sends (its own part included), as nccl-tests does.
  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_bytes, void* recv,
                         absl::Span<const size_t> recv_bytes) override;
  absl::Status Barrier() override { return inner_->Barrier(); }

 private:
  Communicator* inner_;
  EventLog exchanges_;
  EventLog others_;
};

}  // namespace bench
}  // namespace moe

#endif  // MOED_BENCH_GPU_TIMING_H_
