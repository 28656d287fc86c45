#include "server/step_channels.h"

#include <pthread.h>
#include <sys/random.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "transport/shm_object.h"

namespace moe {

struct StepChannels::Channel {
  std::string owner;
  std::unique_ptr<RingChannel> ring;
  std::thread thread;
  std::atomic<bool> closing{false};
  void Close() {
    closing.store(true, std::memory_order_release);
    ring->Stop();
  }
};

namespace {

// 128 random bits as 32 hex digits (getrandom: the kernel's pool).
absl::StatusOr<std::string> RandomHex() {
  char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "getrandom", "a step channel's name");
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

bool PowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

}  // namespace

StepChannels::StepChannels(StepChannelOptions options) : options_(std::move(options)) {}

StepChannels::~StepChannels() {
  CloseAll();
  WaitUntilNoneOpen(absl::InfiniteFuture());
  absl::MutexLock lock(&mu_);
  ReapLocked();
}

absl::StatusOr<StepChannels::Opened> StepChannels::Open(const std::string& owner,
                                                       uint64_t ring_bytes, uint32_t caller_pid,
                                                       absl::Time attach_deadline,
                                                       Handler handler) {
  if (ring_bytes == 0) ring_bytes = options_.default_ring_bytes;
  if (!PowerOfTwo(ring_bytes) || ring_bytes < options_.min_ring_bytes ||
      ring_bytes > options_.max_ring_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring_bytes: ", ring_bytes, " is not a power of two in [", options_.min_ring_bytes, ", ",
        options_.max_ring_bytes, "] (--max_step_channel_bytes)"));
  }
  if (caller_pid == 0 || caller_pid > 0x7FFFFFFF) {
    return absl::InvalidArgumentError(absl::StrCat("caller_pid: ", caller_pid, " is not a pid"));
  }
  attach_deadline = std::min(attach_deadline, absl::Now() + options_.max_attach_wait);
  absl::MutexLock lock(&mu_);
  ReapLocked();
  if (closed_) return absl::UnavailableError("step channels: moed is shutting down");
  if (static_cast<int>(open_.size()) >= options_.max_channels) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "step channels: ", open_.size(), " open, the most moed allows (--max_step_channels)"));
  }
  if (options_.max_per_owner > 0) {
    int mine = 0;
    for (const auto& [id, channel] : open_) mine += channel->owner == owner ? 1 : 0;
    if (mine >= options_.max_per_owner) {
      return absl::ResourceExhaustedError(
          absl::StrCat("step channels: this client has ", mine,
                       " open, the most moed allows (--max_step_channels_per_client)"));
    }
  }
  absl::StatusOr<std::string> random = RandomHex();
  if (!random.ok()) return random.status();
  const std::string name = options_.name_prefix + *random;
  absl::StatusOr<ShmObject> object =
      ShmObject::CreateNamed(name, RingChannel::RegionBytes(ring_bytes));
  if (!object.ok()) return object.status();
  RingChannelOptions ring_options;
  ring_options.ring_bytes = ring_bytes;
  ring_options.max_spin = options_.max_spin;
  absl::StatusOr<std::unique_ptr<RingChannel>> ring =
      RingChannel::Create(std::move(*object), RingChannel::Role::kServer, ring_options);
  if (!ring.ok()) return ring.status();  // the object (and its name) goes with it
  auto channel = std::make_unique<Channel>();
  channel->owner = owner;
  channel->ring = std::move(*ring);
  Channel* raw = channel.get();
  const uint64_t id = next_id_++;
  open_[id] = std::move(channel);
  raw->thread = std::thread([this, raw, caller_pid, attach_deadline,
                             handler = std::move(handler)]() mutable {
    Run(raw, caller_pid, attach_deadline, std::move(handler));
  });
  Opened opened;
  opened.name = name;
  opened.id = id;
  opened.ring_bytes = ring_bytes;
  return opened;
}

void StepChannels::Run(Channel* channel, uint32_t caller_pid, absl::Time attach_deadline,
                       Handler handler) {
  pthread_setname_np(pthread_self(), options_.thread_name.substr(0, 15).c_str());
  RingChannel& ring = *channel->ring;
  absl::Status status;
  while (ring.PeerPid() == 0) {
    if (channel->closing.load(std::memory_order_acquire)) {
      status = absl::CancelledError("closed before the caller attached");
      break;
    }
    if (absl::Now() >= attach_deadline) {
      status = absl::UnavailableError("no caller attached by the open's deadline");
      break;
    }
    absl::SleepFor(absl::Microseconds(200));
  }
  // Attached (or given up): the name goes now, so nothing stays in /dev/shm.
  ring.object().Unlink().IgnoreError();
  if (status.ok() && ring.PeerPid() != caller_pid) {
    status = absl::PermissionDeniedError(absl::StrCat(
        "attached by pid ", ring.PeerPid(), ", not the declared caller_pid ", caller_pid));
  }
  if (status.ok()) {
    const Cancelled cancelled = [channel] {
      return channel->closing.load(std::memory_order_acquire) || !channel->ring->PeerAlive();
    };
    status = ring.Serve([&](absl::string_view record) { return handler(record, cancelled); });
  }
  if (!status.ok() && !absl::IsCancelled(status)) {
    std::fprintf(stderr, "moed: step channel of %s closed: %s\n", channel->owner.c_str(),
                 std::string(status.message()).c_str());
  }
  absl::MutexLock lock(&mu_);
  for (auto it = open_.begin(); it != open_.end(); ++it) {
    if (it->second.get() != channel) continue;
    finished_.push_back(std::move(channel->thread));
    open_.erase(it);  // unmaps the region, closes the fd
    break;
  }
}

void StepChannels::ReapLocked() {
  for (std::thread& thread : finished_) thread.join();
  finished_.clear();
}

absl::Status StepChannels::Close(const std::string& owner, uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(id);
  if (it == open_.end() || it->second->owner != owner) {
    return absl::NotFoundError(absl::StrCat("channel_id: no open step channel ", id, " of yours"));
  }
  it->second->Close();
  return absl::OkStatus();
}

int StepChannels::CloseIf(const std::function<bool(const std::string& owner)>& drop) {
  absl::MutexLock lock(&mu_);
  int closed = 0;
  for (auto& [id, channel] : open_) {
    if (!drop(channel->owner)) continue;
    channel->Close();
    ++closed;
  }
  return closed;
}

void StepChannels::CloseAll() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  for (auto& [id, channel] : open_) channel->Close();
}

int StepChannels::open_count(const std::string& owner) const {
  absl::MutexLock lock(&mu_);
  if (owner.empty()) return static_cast<int>(open_.size());
  int n = 0;
  for (const auto& [id, channel] : open_) n += channel->owner == owner ? 1 : 0;
  return n;
}

bool StepChannels::WaitUntilNoneOpen(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return open_.empty(); };
  return mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
}

}  // namespace moe
