#include "engine/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

absl::Status NcclStatus(ncclResult_t r, ncclComm_t comm, const char* expr, const char* file,
                        int line) {
  const std::string message =
      absl::StrCat("NCCL error ", ncclGetErrorString(r), " in ", expr, " at ", file, ":", line,
                   comm != nullptr ? absl::StrCat(": ", ncclGetLastError(comm)) : "");
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    default:
      return absl::UnavailableError(message);
  }
}

absl::Status CudaCommStatus(cudaError_t e, const char* expr, const char* file, int line) {
  return absl::InternalError(absl::StrCat("CUDA error ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ") in ", expr, " at ", file, ":",
                                          line));
}

#define NCCL_RETURN_IF_ERROR(comm, expr)                              \
  do {                                                                \
    const ncclResult_t _moed_nccl = (expr);                           \
    if (_moed_nccl != ncclSuccess && _moed_nccl != ncclInProgress)    \
      return NcclStatus(_moed_nccl, comm, #expr, __FILE__, __LINE__); \
  } while (0)

#define CUDA_COMM_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                           \
    const cudaError_t _moed_cuda = (expr);                                                       \
    if (_moed_cuda != cudaSuccess) return CudaCommStatus(_moed_cuda, #expr, __FILE__, __LINE__); \
  } while (0)

absl::StatusOr<ncclDataType_t> NcclType(DType t) {
  switch (t) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("AllReduceSum: unsupported dtype ", DTypeName(t)));
  }
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, cudaStream_t stream, CommOptions options)
      : rank_(rank), size_(size), device_(device), stream_(stream), options_(options) {}

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    cudaSetDevice(device_);
    if (comm_ != nullptr && !aborted_) {
      if (broken_) {
        ncclCommAbort(comm_);
      } else {
        cudaStreamSynchronize(stream_);
        ncclCommFinalize(comm_);
        ncclResult_t state = ncclInProgress;
        const absl::Time deadline = absl::Now() + options_.timeout;
        while (state == ncclInProgress && absl::Now() < deadline) {
          ncclCommGetAsyncError(comm_, &state);
          if (state == ncclInProgress) absl::SleepFor(absl::Microseconds(200));
        }
        if (state == ncclSuccess) {
          ncclCommDestroy(comm_);
        } else {
          ncclCommAbort(comm_);
        }
      }
    }
    for (auto& pending : pending_) cudaEventDestroy(pending.event);
    if (barrier_buffer_ != nullptr) cudaFree(barrier_buffer_);
  }

  absl::Status Init(const ncclUniqueId& id) {
    CUDA_COMM_RETURN_IF_ERROR(cudaSetDevice(device_));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm_ != nullptr) ncclCommAbort(comm_);
      comm_ = nullptr;
      return NcclStatus(r, nullptr, "ncclCommInitRankConfig", __FILE__, __LINE__);
    }
    absl::Status s = AwaitState("ncclCommInitRankConfig");
    if (!s.ok()) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      broken_ = true;
      broken_reason_ = s.ToString();
      return s;
    }
    watchdog_ = std::thread([this] { Watch(); });
    return absl::OkStatus();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }
  std::string name() const override { return "nccl"; }

  absl::Status AllReduceSum(void* data, size_t count, DType dtype) override {
    ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(dtype));
    RETURN_IF_ERROR(Begin("AllReduceSum"));
    if (count == 0) return absl::OkStatus();
    if (data == nullptr) return absl::InvalidArgumentError("AllReduceSum: null buffer");
    return Run("AllReduceSum", [&]() -> absl::Status {
      NCCL_RETURN_IF_ERROR(comm_, ncclAllReduce(data, data, count, type, ncclSum, comm_, stream_));
      return absl::OkStatus();
    });
  }

  absl::Status AllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    RETURN_IF_ERROR(Begin("AllGather"));
    if (bytes_per_rank == 0) return absl::OkStatus();
    if (send == nullptr || recv == nullptr) {
      return absl::InvalidArgumentError("AllGather: null buffer");
    }
    return Run("AllGather", [&]() -> absl::Status {
      NCCL_RETURN_IF_ERROR(comm_,
                           ncclAllGather(send, recv, bytes_per_rank, ncclUint8, comm_, stream_));
      return absl::OkStatus();
    });
  }

  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_bytes, void* recv,
                         absl::Span<const size_t> recv_bytes) override {
    if (send_bytes.size() != static_cast<size_t>(size_) ||
        recv_bytes.size() != static_cast<size_t>(size_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("AllToAllV: need ", size_, " send and receive sizes"));
    }
    if (send_bytes[rank_] != recv_bytes[rank_]) {
      return absl::InvalidArgumentError(absl::StrCat("AllToAllV: rank ", rank_, " sends itself ",
                                                     send_bytes[rank_], " bytes but expects ",
                                                     recv_bytes[rank_]));
    }
    size_t total_send = 0, total_recv = 0;
    for (int r = 0; r < size_; ++r) {
      total_send += send_bytes[r];
      total_recv += recv_bytes[r];
    }
    if ((total_send > 0 && send == nullptr) || (total_recv > 0 && recv == nullptr)) {
      return absl::InvalidArgumentError("AllToAllV: null buffer");
    }
    RETURN_IF_ERROR(Begin("AllToAllV"));
    const char* s = static_cast<const char*>(send);
    char* d = static_cast<char*>(recv);
    std::vector<size_t> send_off(size_, 0), recv_off(size_, 0);
    for (int r = 1; r < size_; ++r) {
      send_off[r] = send_off[r - 1] + send_bytes[r - 1];
      recv_off[r] = recv_off[r - 1] + recv_bytes[r - 1];
    }
    // One rank: a device copy. Several: the part for itself goes through NCCL too (a send and
    // receive to itself in the same group), so that it overlaps the peer transfers instead of
    // running before them.
    if (size_ == 1) {
      if (send_bytes[0] > 0) {
        CUDA_COMM_RETURN_IF_ERROR(
            cudaMemcpyAsync(d, s, send_bytes[0], cudaMemcpyDeviceToDevice, stream_));
      }
      return absl::OkStatus();
    }
    bool any = false;
    for (int r = 0; r < size_; ++r) any |= send_bytes[r] > 0 || recv_bytes[r] > 0;
    if (!any) return absl::OkStatus();
    return Run("AllToAllV", [&]() -> absl::Status {
      NCCL_RETURN_IF_ERROR(comm_, ncclGroupStart());
      for (int r = 0; r < size_; ++r) {
        if (send_bytes[r] > 0) {
          NCCL_RETURN_IF_ERROR(
              comm_, ncclSend(s + send_off[r], send_bytes[r], ncclUint8, r, comm_, stream_));
        }
        if (recv_bytes[r] > 0) {
          NCCL_RETURN_IF_ERROR(
              comm_, ncclRecv(d + recv_off[r], recv_bytes[r], ncclUint8, r, comm_, stream_));
        }
      }
      NCCL_RETURN_IF_ERROR(comm_, ncclGroupEnd());
      return absl::OkStatus();
    });
  }

  absl::Status Barrier() override {
    RETURN_IF_ERROR(Begin("Barrier"));
    if (barrier_buffer_ == nullptr) {
      CUDA_COMM_RETURN_IF_ERROR(cudaMalloc(&barrier_buffer_, sizeof(int32_t)));
    }
    RETURN_IF_ERROR(Run("Barrier", [&]() -> absl::Status {
      NCCL_RETURN_IF_ERROR(comm_, ncclAllReduce(barrier_buffer_, barrier_buffer_, 1, ncclInt32,
                                                ncclSum, comm_, stream_));
      return absl::OkStatus();
    }));
    // Wait for the stream (and so the all-reduce) with the timeout, never indefinitely.
    cudaEvent_t done;
    CUDA_COMM_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CUDA_COMM_RETURN_IF_ERROR(cudaEventRecord(done, stream_));
    const absl::Time deadline = absl::Now() + options_.timeout;
    cudaError_t q;
    while ((q = cudaEventQuery(done)) == cudaErrorNotReady && !broken_ && absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(50));
    }
    cudaEventDestroy(done);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return CudaCommStatus(q, "Barrier", __FILE__, __LINE__);
    return absl::DeadlineExceededError(
        absl::StrCat("Barrier: rank ", rank_, " waited ", absl::FormatDuration(options_.timeout)));
  }

 private:
  struct Pending {
    cudaEvent_t event;
    absl::Time deadline;
    std::string what;
  };

  absl::Status Broken() const {
    return absl::UnavailableError(absl::StrCat("NCCL communicator (rank ", rank_, " of ", size_,
                                               ") is broken: ", broken_reason_));
  }

  // Before an operation: the communicator is usable and the device current.
  absl::Status Begin(const char* op) {
    if (broken_) return Broken();
    CUDA_COMM_RETURN_IF_ERROR(cudaSetDevice(device_));
    (void)op;
    return absl::OkStatus();
  }

  // Enqueues an operation: `enqueue` makes the NCCL calls; then NCCL's (non-blocking) enqueue
  // is awaited, all under nccl_mu_, and the op is handed to the watchdog.
  template <typename Fn>
  absl::Status Run(const char* op, const Fn& enqueue) {
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (broken_) return Broken();
      RETURN_IF_ERROR(enqueue());
      RETURN_IF_ERROR(AwaitState(op));
    }
    cudaEvent_t event;
    CUDA_COMM_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    CUDA_COMM_RETURN_IF_ERROR(cudaEventRecord(event, stream_));
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(Pending{event, absl::Now() + options_.timeout, op});
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

  absl::Status AwaitState(const char* op) {
    const absl::Time deadline = absl::Now() + options_.timeout;
    ncclResult_t state = ncclInProgress;
    while (true) {
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return NcclStatus(r, comm_, op, __FILE__, __LINE__);
      if (state != ncclInProgress) break;
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("NCCL ", op, " on rank ", rank_, " not ready after ",
                         absl::FormatDuration(options_.timeout), " (a peer missing?)"));
      }
      absl::SleepFor(absl::Microseconds(20));
    }
    if (state != ncclSuccess) return NcclStatus(state, comm_, op, __FILE__, __LINE__);
    return absl::OkStatus();
  }

  // Watchdog: retires completed operations; aborts on a timeout or an asynchronous error.
  // It never holds mu_ and nccl_mu_ together (Run takes them one after the other), and it
  // touches NCCL only under nccl_mu_: NCCL's non-blocking state (ncclCommGetAsyncError
  // completes pending group jobs) must not be driven from two threads at once.
  void Watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 200 : 1));
      if (stop_) break;
      while (!pending_.empty() && cudaEventQuery(pending_.front().event) == cudaSuccess) {
        cudaEventDestroy(pending_.front().event);
        pending_.pop_front();
      }
      std::string reason;
      if (!pending_.empty() && absl::Now() > pending_.front().deadline) {
        reason = absl::StrCat(pending_.front().what, " did not finish within ",
                              absl::FormatDuration(options_.timeout));
      }
      lock.unlock();
      if (reason.empty()) {
        std::unique_lock<std::mutex> nccl(nccl_mu_, std::try_to_lock);
        ncclResult_t async = ncclSuccess;
        if (nccl.owns_lock()) ncclCommGetAsyncError(comm_, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          reason = absl::StrCat("asynchronous NCCL error ", ncclGetErrorString(async));
        }
      }
      if (!reason.empty()) {
        std::lock_guard<std::mutex> nccl(nccl_mu_);  // Run holds it only for a bounded time
        broken_reason_ = reason;
        broken_ = true;
        ncclCommAbort(comm_);  // unblocks the spinning kernels; comm_ is dead from here on
        aborted_ = true;
        return;
      }
      lock.lock();
    }
  }

  const int rank_, size_, device_;
  const cudaStream_t stream_;
  const CommOptions options_;
  ncclComm_t comm_ = nullptr;
  void* barrier_buffer_ = nullptr;
  std::atomic<bool> broken_{false};
  bool aborted_ = false;       // by the watchdog (read after it has been joined)
  std::string broken_reason_;  // written once, before broken_ becomes true

  std::mutex nccl_mu_;  // held around every NCCL call on comm_ after Init
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;  // guarded by mu_
  bool stop_ = false;            // guarded by mu_
  std::thread watchdog_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    std::shared_ptr<KeyValueStore> store, const std::string& prefix, int rank, int size, int device,
    void* stream, const CommOptions& options) {
  if (store == nullptr) return absl::InvalidArgumentError("MakeNcclCommunicator: null store");
  if (size <= 0 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("MakeNcclCommunicator: rank ", rank, " of size ", size));
  }
  if (stream == nullptr) {
    return absl::InvalidArgumentError("MakeNcclCommunicator: needs the backend's CUDA stream");
  }
  CUDA_COMM_RETURN_IF_ERROR(cudaSetDevice(device));
  const std::string key = prefix + "/nccl_unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    NCCL_RETURN_IF_ERROR(nullptr, ncclGetUniqueId(&id));
    RETURN_IF_ERROR(store->Set(
        key, absl::BytesToHexString(absl::string_view(id.internal, sizeof(id.internal)))));
  } else {
    ASSIGN_OR_RETURN(std::string hex, store->Get(key, options.timeout));
    const std::string bytes = absl::HexStringToBytes(hex);
    if (bytes.size() != sizeof(id.internal)) {
      return absl::DataLossError(
          absl::StrCat("NCCL unique id under ", key, " has ", bytes.size(), " bytes"));
    }
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }
  auto comm = std::make_unique<NcclCommunicator>(rank, size, device,
                                                 static_cast<cudaStream_t>(stream), options);
  RETURN_IF_ERROR(comm->Init(id));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace moe
