#include "engine/comm/gloo_communicator.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoall.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace moe {
namespace {

// Thrown by our own code running inside a Gloo call (the store adapter, the all-to-all size
// check) so that its Status (e.g. the store's DEADLINE_EXCEEDED for a rank that never showed
// up) crosses Gloo unchanged.
struct StatusError : std::exception {
  explicit StatusError(absl::Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return "status error"; }
  absl::Status status;
};

// The one check for the Gloo error domain: runs `fn` and turns whatever Gloo throws into a
// Status naming the operation. Gloo reports both timeouts and lost peers as IoException; its
// timeout messages say "Timed out" / "timeout".
template <typename Fn>
absl::Status CallGloo(const std::string& what, Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const StatusError& e) {  // already ours
    return absl::Status(e.status.code(), absl::StrCat("gloo ", what, ": ", e.status.message()));
  } catch (const gloo::IoException& e) {
    const std::string message = absl::StrCat("gloo ", what, ": ", e.what());
    const std::string lower = absl::AsciiStrToLower(e.what());
    if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
      return absl::DeadlineExceededError(message);
    }
    return absl::UnavailableError(message);
  } catch (const gloo::Exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo ", what, ": ", e.what()));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(absl::StrCat("gloo ", what, ": ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("gloo ", what, ": ", e.what()));
  }
}

// Gloo adds the timeout to a clock in nanoseconds: a longer one (absl::InfiniteDuration is
// INT64_MAX ms) overflowed into an instant timeout. Ten years is "wait" for a collective.
std::chrono::milliseconds ToChrono(absl::Duration d) {
  const absl::Duration capped = std::min(d, absl::Hours(24 * 365 * 10));
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(capped)));
}

// Our KeyValueStore seen as Gloo's rendezvous store, every key under "<prefix>/".
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<KeyValueStore> store, std::string prefix, absl::Duration timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_->Set(Key(key), std::string(data.begin(), data.end()));
    if (!s.ok()) throw StatusError(std::move(s));
  }

  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = store_->Get(Key(key), timeout_);
    if (!value.ok()) throw StatusError(value.status());
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, ToChrono(timeout_)); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
    for (const std::string& key : keys) {
      absl::StatusOr<std::string> value =
          store_->Get(Key(key), std::max(deadline - absl::Now(), absl::ZeroDuration()));
      if (!value.ok()) throw StatusError(value.status());
    }
  }

 private:
  std::string Key(const std::string& key) const { return absl::StrCat(prefix_, "/", key); }

  std::shared_ptr<KeyValueStore> store_;
  const std::string prefix_;
  const absl::Duration timeout_;
};

template <typename T>
void SumInto(void* c, const void* a, const void* b, size_t n) {
  T* out = static_cast<T*>(c);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

template <typename T>
void SetSumOutput(gloo::AllreduceOptions& opts, void* data, size_t count) {
  opts.setOutput(static_cast<T*>(data), count);
  opts.setReduceFunction(&SumInto<T>);
}

// A valid address for zero-byte buffers: Gloo builds a buffer object even for 0 bytes.
char zero_size_anchor;

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> context, int rank, int size,
                   const CommOptions& options)
      : context_(std::move(context)), rank_(rank), size_(size), options_(options) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  std::string name() const override { return "gloo"; }

  absl::Status AllReduceSum(void* data, size_t count, DType dtype) override {
    if (dtype != DType::kFloat32 && dtype != DType::kFloat64 && dtype != DType::kInt32 &&
        dtype != DType::kInt64) {
      return absl::InvalidArgumentError(
          absl::StrCat("gloo AllReduceSum: unsupported dtype ", DTypeName(dtype)));
    }
    if (count > 0 && data == nullptr) {
      return absl::InvalidArgumentError("gloo AllReduceSum: null data");
    }
    return Run("allreduce", [&](uint32_t tag) {
      if (count == 0) return;  // every rank skips alike
      gloo::AllreduceOptions opts(context_);
      switch (dtype) {
        case DType::kFloat32:
          SetSumOutput<float>(opts, data, count);
          break;
        case DType::kFloat64:
          SetSumOutput<double>(opts, data, count);
          break;
        case DType::kInt32:
          SetSumOutput<int32_t>(opts, data, count);
          break;
        default:
          SetSumOutput<int64_t>(opts, data, count);
          break;
      }
      opts.setTag(tag);
      opts.setTimeout(ToChrono(options_.timeout));
      gloo::allreduce(opts);
    });
  }

  absl::Status AllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    if (bytes_per_rank > 0 && (send == nullptr || recv == nullptr)) {
      return absl::InvalidArgumentError("gloo AllGather: null buffer");
    }
    return Run("allgather", [&](uint32_t tag) {
      if (bytes_per_rank == 0) return;
      gloo::AllgatherOptions opts(context_);
      opts.setInput(static_cast<uint8_t*>(const_cast<void*>(send)), bytes_per_rank);
      opts.setOutput(static_cast<uint8_t*>(recv), bytes_per_rank * size_);
      opts.setTag(tag);
      opts.setTimeout(ToChrono(options_.timeout));
      gloo::allgather(opts);
    });
  }

  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_bytes, void* recv,
                         absl::Span<const size_t> recv_bytes) override {
    // The arguments are checked inside Run: a bad call is a caller bug that breaks the
    // communicator and closes its connections, so the peers waiting in this collective fail
    // at once instead of at their timeout.
    return Run("alltoallv", [&](uint32_t tag) {
      if (send_bytes.size() != static_cast<size_t>(size_) ||
          recv_bytes.size() != static_cast<size_t>(size_)) {
        throw StatusError(absl::InvalidArgumentError(
            absl::StrCat(send_bytes.size(), " send sizes and ", recv_bytes.size(),
                         " receive sizes for ", size_, " ranks")));
      }
      if (send_bytes[rank_] != recv_bytes[rank_]) {
        throw StatusError(absl::InvalidArgumentError(
            absl::StrCat("rank ", rank_, " sends itself ", send_bytes[rank_], " bytes but expects ",
                         recv_bytes[rank_])));
      }
      const size_t send_total = std::accumulate(send_bytes.begin(), send_bytes.end(), size_t{0});
      const size_t recv_total = std::accumulate(recv_bytes.begin(), recv_bytes.end(), size_t{0});
      if ((send_total > 0 && send == nullptr) || (recv_total > 0 && recv == nullptr)) {
        throw StatusError(absl::InvalidArgumentError("null buffer"));
      }
      if (size_ == 1) {  // Gloo needs no peers for this; avoid its buffer setup
        if (send_total > 0) std::memmove(recv, send, send_total);
        return;
      }
      const absl::Time deadline = absl::Now() + options_.timeout;
      // Gloo aborts the process when a peer sends more bytes than we posted and silently
      // leaves the tail unwritten when it sends fewer, so the sizes are checked first with a
      // fixed-size exchange: what each rank will send me against what I expect. A mismatch
      // is the caller's bug; it fails here (and, by closing the connections, at the peers).
      std::vector<uint64_t> announced(send_bytes.begin(), send_bytes.end());
      std::vector<uint64_t> incoming(size_, 0);
      gloo::AlltoallOptions sizes(context_);
      sizes.setInput(announced.data(), announced.size());
      sizes.setOutput(incoming.data(), incoming.size());
      sizes.setTag(tag);
      sizes.setTimeout(ToChrono(options_.timeout));
      gloo::alltoall(sizes);
      for (int peer = 0; peer < size_; ++peer) {
        if (incoming[peer] != recv_bytes[peer]) {
          throw StatusError(absl::InvalidArgumentError(
              absl::StrCat("rank ", rank_, " expects ", recv_bytes[peer], " bytes from rank ", peer,
                           ", which sends ", incoming[peer])));
        }
      }
      std::vector<int64_t> send_counts(send_bytes.begin(), send_bytes.end());
      std::vector<int64_t> recv_counts(recv_bytes.begin(), recv_bytes.end());
      gloo::AlltoallvOptions opts(context_);
      opts.setInput(send_total > 0 ? static_cast<uint8_t*>(const_cast<void*>(send))
                                   : reinterpret_cast<uint8_t*>(&zero_size_anchor),
                    std::move(send_counts));
      opts.setOutput(recv_total > 0 ? static_cast<uint8_t*>(recv)
                                    : reinterpret_cast<uint8_t*>(&zero_size_anchor),
                     std::move(recv_counts));
      opts.setTag(tag);
      opts.setTimeout(ToChrono(deadline - absl::Now()));
      gloo::alltoallv(opts);
    });
  }

  absl::Status Barrier() override {
    return Run("barrier", [&](uint32_t tag) {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(ToChrono(options_.timeout));
      gloo::barrier(opts);
    });
  }

 private:
  // Runs one collective with the next tag; on failure marks the communicator broken. Every
  // rank calls collectives in the same order, so the tags agree without any exchange.
  template <typename Fn>
  absl::Status Run(const char* what, Fn&& fn) {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "gloo ", what, ": communicator is broken by an earlier failure: ", broken_.message()));
    }
    const uint32_t tag = next_tag_++;
    absl::Status status =
        CallGloo(absl::StrCat(what, " (rank ", rank_, " of ", size_, ")"), [&] { fn(tag); });
    if (!status.ok()) {
      broken_ = status;
      // Gloo closes the pairs itself after a timeout; after other errors close them too, so
      // that peers still waiting on us fail now instead of at their own timeout.
      CallGloo("close", [&] { context_->closeConnections(); }).IgnoreError();
    }
    return status;
  }

  const std::shared_ptr<gloo::rendezvous::Context> context_;
  const int rank_;
  const int size_;
  const CommOptions options_;
  absl::Mutex mu_;
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

// Where this rank listens: the options, else (both empty) Gloo's default, the host's name.
gloo::transport::tcp::attr DeviceAttr(const GlooTransportOptions& transport) {
  gloo::transport::tcp::attr attr;
  attr.iface = transport.iface;
  attr.hostname = transport.hostname;
  return attr;
}

// Gloo's TCP device runs one event-loop thread (epoll) serving every pair of the contexts that
// use it. A device per communicator was a thread per layer on every worker (850 small layers:
// 864 threads, creation slowing down, pings timing out); instead the communicators of a
// process share kSharedDevices devices per listening address, handed out in turn, so a few
// layers' collectives still progress on different threads. The devices live as long as the
// process (a context keeps its device alive anyway).
constexpr size_t kSharedDevices = 4;

std::shared_ptr<gloo::transport::Device> SharedDevice(const gloo::transport::tcp::attr& attr) {
  static absl::Mutex mu(absl::kConstInit);
  struct Devices {
    std::vector<std::shared_ptr<gloo::transport::Device>> devices;
    size_t next = 0;  // once all exist, the next one handed out
  };
  static auto* by_address = new std::map<std::pair<std::string, std::string>, Devices>;
  static pid_t owner = 0;
  absl::MutexLock lock(&mu);
  if (owner != getpid()) {  // a forked child: the parent's loop threads do not exist here
    by_address = new std::map<std::pair<std::string, std::string>, Devices>;
    owner = getpid();
  }
  Devices& shared = (*by_address)[{attr.iface, attr.hostname}];
  if (shared.devices.size() < kSharedDevices) {
    shared.devices.push_back(gloo::transport::tcp::CreateDevice(attr));  // may throw: no change
    return shared.devices.back();
  }
  return shared.devices[shared.next++ % kSharedDevices];
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(
    std::shared_ptr<KeyValueStore> store, const std::string& prefix, int rank, int size,
    const CommOptions& options, const GlooTransportOptions& transport) {
  if (store == nullptr) return absl::InvalidArgumentError("MakeGlooCommunicator: null store");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("MakeGlooCommunicator: rank ", rank, " of size ", size));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("MakeGlooCommunicator: timeout ",
                                                   absl::FormatDuration(options.timeout),
                                                   " must be positive"));
  }
  static std::once_flag ignore_sigpipe;
  std::call_once(ignore_sigpipe, [] { signal(SIGPIPE, SIG_IGN); });

  std::shared_ptr<gloo::rendezvous::Context> context;
  const std::string what =
      absl::StrCat("connect (rank ", rank, " of ", size, ", prefix '", prefix, "')");
  absl::Status connected = CallGloo(what, [&] {
    std::shared_ptr<gloo::transport::Device> device = SharedDevice(DeviceAttr(transport));
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(ToChrono(options.timeout));
    StoreAdapter adapter(store, prefix, options.timeout);
    context->connectFullMesh(adapter, device);
  });
  if (!connected.ok()) return connected;
  return std::unique_ptr<Communicator>(
      new GlooCommunicator(std::move(context), rank, size, options));
}

}  // namespace moe
