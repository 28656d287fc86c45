#include "transport/ring_channel.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {
namespace {

using ring_layout::kDataOffset;
using ring_layout::RegionHeader;
using ring_layout::RingControl;

bool IsPowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

absl::Status CheckRingBytes(uint64_t ring_bytes) {
  if (!IsPowerOfTwo(ring_bytes) || ring_bytes < ring_layout::kMinRingBytes ||
      ring_bytes > ring_layout::kMaxRingBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring_bytes ", ring_bytes, " is not a power of two in [4096, 2^30]"));
  }
  return absl::OkStatus();
}

// False once `pid` has exited: gone (ESRCH), or a zombie its parent has not reaped yet.
// `thorough` also reads /proc (the zombie case); kill(2) alone is the cheap test.
bool ProcessAlive(uint32_t pid, bool thorough) {
  if (pid == 0) return true;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  if (!thorough) return true;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: trust kill(2)
  const size_t paren = line.rfind(')');        // "pid (comm) S ..."; comm may hold spaces
  if (paren == std::string::npos || paren + 2 >= line.size()) return true;
  const char state = line[paren + 2];
  return state != 'Z' && state != 'X';
}

const char* RoleName(RingChannel::Role role) {
  return role == RingChannel::Role::kCaller ? "caller" : "server";
}

}  // namespace

RingChannel::RingChannel(ShmObject object, ShmMapping mapping, Role role,
                         const RingChannelOptions& options)
    : object_(std::move(object)), mapping_(std::move(mapping)), role_(role), options_(options) {}

absl::StatusOr<std::unique_ptr<RingChannel>> RingChannel::Create(
    ShmObject object, Role role, const RingChannelOptions& options) {
  if (absl::Status s = CheckRingBytes(options.ring_bytes); !s.ok()) return s;
  if (object.size() != RegionBytes(options.ring_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(object.name(), ": ", object.size(), " bytes, a channel of rings of ",
                     options.ring_bytes, " bytes needs ", RegionBytes(options.ring_bytes)));
  }
  absl::StatusOr<ShmMapping> mapping = object.Map();
  if (!mapping.ok()) return mapping.status();
  char* base = mapping->data();
  std::memset(base, 0, kDataOffset);
  auto* header = reinterpret_cast<RegionHeader*>(base);
  header->version = ring_layout::kVersion;
  header->region_bytes = RegionBytes(options.ring_bytes);
  header->ring_bytes = options.ring_bytes;
  __atomic_store_n(&header->magic, ring_layout::kMagic, __ATOMIC_RELEASE);  // complete now
  return Join(std::move(object), *std::move(mapping), role, options);
}

absl::StatusOr<std::unique_ptr<RingChannel>> RingChannel::Attach(
    ShmObject object, Role role, const RingChannelOptions& options) {
  if (object.size() < kDataOffset) {
    return absl::InvalidArgumentError(
        absl::StrCat(object.name(), ": ", object.size(), " bytes is too small for a ring channel"));
  }
  absl::StatusOr<ShmMapping> mapping = object.Map();
  if (!mapping.ok()) return mapping.status();
  return Join(std::move(object), *std::move(mapping), role, options);
}

absl::StatusOr<std::unique_ptr<RingChannel>> RingChannel::Join(ShmObject object, ShmMapping mapping,
                                                               Role role,
                                                               const RingChannelOptions& options) {
  auto* header = reinterpret_cast<RegionHeader*>(mapping.data());
  // Each field read once into a local: the peer may change the bytes while we look.
  const uint32_t magic = __atomic_load_n(&header->magic, __ATOMIC_ACQUIRE);
  const uint32_t version = header->version;
  const uint64_t region_bytes = header->region_bytes;
  const uint64_t ring_bytes = header->ring_bytes;
  const std::string what = object.name();
  if (magic != ring_layout::kMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a ring channel (magic 0x", absl::Hex(magic), ")"));
  }
  if (version != ring_layout::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ring channel version ", version,
                                                   ", this build speaks ", ring_layout::kVersion));
  }
  if (absl::Status s = CheckRingBytes(ring_bytes); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  }
  if (region_bytes != RegionBytes(ring_bytes) || mapping.size() != region_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": header says ", region_bytes,
                                                   " bytes for rings of ", ring_bytes,
                                                   ", the object has ", mapping.size()));
  }
  std::atomic<uint32_t>& own_pid = role == Role::kCaller ? header->caller_pid : header->server_pid;
  uint32_t expected = 0;
  if (!own_pid.compare_exchange_strong(expected, static_cast<uint32_t>(getpid()))) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": the channel already has a ",
                                                      RoleName(role), " (pid ", expected, ")"));
  }
  char* base = mapping.data();
  auto* request_control = reinterpret_cast<RingControl*>(base + ring_layout::kRequestControlOffset);
  auto* response_control =
      reinterpret_cast<RingControl*>(base + ring_layout::kResponseControlOffset);
  char* request_data = base + kDataOffset;
  char* response_data = request_data + ring_bytes;

  RingChannelOptions effective = options;
  effective.ring_bytes = ring_bytes;
  std::unique_ptr<RingChannel> channel(
      new RingChannel(std::move(object), std::move(mapping), role, effective));
  const bool caller = role == Role::kCaller;
  channel->outgoing_ = std::make_unique<StepRing>(caller ? request_control : response_control,
                                                  caller ? request_data : response_data, ring_bytes,
                                                  StepRing::Side::kProducer, options.max_spin);
  channel->incoming_ = std::make_unique<StepRing>(caller ? response_control : request_control,
                                                  caller ? response_data : request_data, ring_bytes,
                                                  StepRing::Side::kConsumer, options.max_spin);
  if (absl::Status s = channel->outgoing_->Init(); !s.ok()) return s;
  if (absl::Status s = channel->incoming_->Init(); !s.ok()) return s;
  return channel;
}

RingChannel::~RingChannel() {
  if (outgoing_ == nullptr) return;
  std::atomic<uint32_t>& closed =
      role_ == Role::kCaller ? header()->caller_closed : header()->server_closed;
  closed.store(1, std::memory_order_release);
  outgoing_->RingPeer();  // the peer, if it waits for our next record, looks at the flag
}

absl::Status RingChannel::CheckPeer(bool timed_out) {
  RegionHeader* h = header();
  const bool caller = role_ == Role::kCaller;
  if (!caller && stop_.load(std::memory_order_acquire)) return absl::CancelledError("stopped");
  const std::atomic<uint32_t>& closed = caller ? h->server_closed : h->caller_closed;
  if (closed.load(std::memory_order_acquire) != 0) {
    return caller ? absl::UnavailableError("ring channel: the server closed the channel")
                  : absl::CancelledError("the caller closed the channel");
  }
  if (peer_pid_ == 0) {
    peer_pid_ = (caller ? h->server_pid : h->caller_pid).load(std::memory_order_acquire);
  }
  if (!timed_out) return absl::OkStatus();
  if (!ProcessAlive(peer_pid_, /*thorough=*/true)) {
    return absl::UnavailableError(absl::StrCat("ring channel: the ", caller ? "server" : "caller",
                                               " process (pid ", peer_pid_, ") exited"));
  }
  return absl::OkStatus();
}

RingWait RingChannel::MakeWait(absl::Time deadline, const std::function<bool()>* cancelled) {
  RingWait wait;
  wait.deadline = deadline;
  wait.check_interval = options_.peer_check_interval;
  wait.check = [this, cancelled](bool timed_out) {
    if (cancelled != nullptr && *cancelled && (*cancelled)()) {
      return absl::CancelledError("ring channel: the call was cancelled");
    }
    return CheckPeer(timed_out);
  };
  return wait;
}

absl::StatusOr<std::string> RingChannel::Call(absl::string_view request, absl::Time deadline,
                                              bool* answered) {
  return Call(request, deadline, std::function<bool()>(), answered);
}

absl::StatusOr<std::string> RingChannel::Call(absl::string_view request, absl::Time deadline,
                                              const std::function<bool()>& cancelled,
                                              bool* answered) {
  if (answered != nullptr) *answered = false;
  if (role_ != Role::kCaller) return absl::FailedPreconditionError("Call on the server side");
  absl::MutexLock lock(&call_mu_);
  if (absl::Status s = CheckPeer(/*timed_out=*/false); !s.ok()) return s;
  const uint64_t sequence = next_sequence_++;
  const RingWait wait = MakeWait(deadline, &cancelled);
  if (absl::Status s = outgoing_->Push(sequence, 0, request, wait); !s.ok()) return s;
  for (;;) {
    absl::StatusOr<StepRing::Record> response = incoming_->Pop(wait);
    if (absl::IsDeadlineExceeded(response.status())) {
      return absl::DeadlineExceededError(
          absl::StrCat("ring channel: no response to call ", sequence, " before the deadline"));
    }
    if (!response.ok()) return response.status();
    if (response->sequence < sequence) continue;  // the late answer of a call that timed out
    if (response->sequence > sequence) {
      return absl::DataLossError(absl::StrCat("ring channel corrupt: response ", response->sequence,
                                              " to call ", sequence));
    }
    if (response->status_code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
      return absl::DataLossError(
          absl::StrCat("ring channel corrupt: status code ", response->status_code));
    }
    if (answered != nullptr) *answered = true;
    if (response->status_code != 0) {
      return absl::Status(static_cast<absl::StatusCode>(response->status_code), response->payload);
    }
    return std::move(response->payload);
  }
}

absl::Status RingChannel::Serve(const Handler& handler) {
  if (role_ != Role::kServer) return absl::FailedPreconditionError("Serve on the caller side");
  const absl::Time attach_deadline = absl::Now() + options_.attach_timeout;
  RingWait wait = MakeWait(absl::InfiniteFuture());
  wait.check = [this, attach_deadline](bool timed_out) -> absl::Status {
    if (absl::Status s = CheckPeer(timed_out); !s.ok()) return s;
    if (peer_pid_ == 0 && absl::Now() >= attach_deadline) {
      return absl::UnavailableError(absl::StrCat("ring channel: no caller attached within ",
                                                 absl::FormatDuration(options_.attach_timeout)));
    }
    return absl::OkStatus();
  };
  for (;;) {
    absl::StatusOr<StepRing::Record> request = incoming_->Pop(wait);
    if (absl::IsCancelled(request.status())) return absl::OkStatus();  // closed or stopped
    if (!request.ok()) return request.status();
    absl::StatusOr<std::string> response = handler(request->payload);
    absl::Status pushed;
    if (!response.ok()) {
      pushed = outgoing_->Push(request->sequence, static_cast<uint32_t>(response.status().code()),
                               response.status().message(), wait);
    } else if (response->size() > outgoing_->max_payload()) {
      pushed = outgoing_->Push(request->sequence,
                               static_cast<uint32_t>(absl::StatusCode::kResourceExhausted),
                               absl::StrCat("response of ", response->size(),
                                            " bytes exceeds the ring's ", outgoing_->max_payload()),
                               wait);
    } else {
      pushed = outgoing_->Push(request->sequence, 0, *response, wait);
    }
    if (absl::IsCancelled(pushed)) return absl::OkStatus();
    if (!pushed.ok()) return pushed;
  }
}

absl::Status RingChannel::WaitForPeer(absl::Time deadline) {
  const std::atomic<uint32_t>& pid =
      role_ == Role::kCaller ? header()->server_pid : header()->caller_pid;
  while (pid.load(std::memory_order_acquire) == 0) {
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat("ring channel ", name(), ": no ",
                                                 role_ == Role::kCaller ? "server" : "caller",
                                                 " attached before the deadline"));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
  return absl::OkStatus();
}

void RingChannel::Stop() { stop_.store(true, std::memory_order_release); }

uint32_t RingChannel::PeerPid() const {
  const RegionHeader* h = header();
  return (role_ == Role::kCaller ? h->server_pid : h->caller_pid).load(std::memory_order_acquire);
}

bool RingChannel::PeerAlive() const {
  const RegionHeader* h = header();
  const std::atomic<uint32_t>& closed = role_ == Role::kCaller ? h->server_closed : h->caller_closed;
  if (closed.load(std::memory_order_acquire) != 0) return false;
  return ProcessAlive(PeerPid(), /*thorough=*/true);
}

}  // namespace moe
