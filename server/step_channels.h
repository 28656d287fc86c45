// StepChannels: the step channels (transport/ring_channel.h) one server process serves, one
// thread each (transport/README.md "Phase 2"). Open() creates a channel's region under a
// random POSIX name (mode 0600) and starts its thread, which waits for the caller to attach
// by the open's deadline, refuses (closes) a channel attached by another pid than the one
// declared, unlinks the name as soon as the caller attached (nothing stays in /dev/shm,
// whoever dies later), then answers the caller's records with the channel's handler until
// the caller closes its side or exits, Close() / CloseIf() / CloseAll() is called, or the
// channel is corrupt. The thread then frees the channel (region unmapped, fd closed).
// Knows nothing of moed's RPCs: the handler does (server/moe_service_channels.cc); the worker
// hop can serve its channels with it too.
//
//   StepChannels channels(options);
//   ASSIGN_OR_RETURN(StepChannels::Opened opened,
//                    channels.Open("token ab12..", 1 << 22, pid, absl::Now() + absl::Seconds(5),
//                                  [](absl::string_view record, const StepChannels::Cancelled&
//                                     cancelled) { return Answer(record); }));
//   ... hand opened.name to the caller ...
#ifndef MOED_SERVER_STEP_CHANNELS_H_
#define MOED_SERVER_STEP_CHANNELS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/ring_channel.h"

namespace moe {

struct StepChannelOptions {
  int max_channels = 64;         // open at once, all owners; beyond: RESOURCE_EXHAUSTED
  int max_per_owner = 0;         // open at once per owner; 0: no per-owner bound
  uint64_t min_ring_bytes = uint64_t{64} << 10;
  uint64_t max_ring_bytes = uint64_t{64} << 20;
  uint64_t default_ring_bytes = uint64_t{4} << 20;  // for ring_bytes 0
  absl::Duration max_attach_wait = absl::Seconds(10);  // caps Open's attach deadline
  std::string name_prefix = "/moed-ring-";             // + 32 random hex digits
  std::string thread_name = "moed-ring";               // each channel's thread (15 chars max)
  absl::Duration max_spin = absl::ZeroDuration();  // doorbell spin (transport/doorbell.h)
};

class StepChannels {
 public:
  // True once the channel is being closed or its caller left (closed its side or exited):
  // the handler's step may drop its answer.
  using Cancelled = std::function<bool()>;
  // Answers one record (the channel's private copy); an error status goes back as the
  // record's status code and message.
  using Handler =
      std::function<absl::StatusOr<std::string>(absl::string_view record, const Cancelled&)>;
  struct Opened {
    std::string name;  // the POSIX name the caller opens
    uint64_t id = 0;
    uint64_t ring_bytes = 0;
  };

  explicit StepChannels(StepChannelOptions options);
  ~StepChannels();  // CloseAll(), then waits for every channel's thread

  // A new channel of `owner` for the process `caller_pid`, rings of `ring_bytes` (0: the
  // default; else a power of two in [min, max], INVALID_ARGUMENT). RESOURCE_EXHAUSTED past
  // max_channels or max_per_owner, UNAVAILABLE after CloseAll(). The caller must attach by
  // `attach_deadline` (capped at now + max_attach_wait), else the channel goes.
  absl::StatusOr<Opened> Open(const std::string& owner, uint64_t ring_bytes, uint32_t caller_pid,
                              absl::Time attach_deadline, Handler handler);
  // Closes channel `id` of `owner` (NOT_FOUND when `owner` has none of that id). Its thread
  // ends after the record it is answering, if any.
  absl::Status Close(const std::string& owner, uint64_t id);
  // Closes every channel whose owner `drop` names; returns how many.
  int CloseIf(const std::function<bool(const std::string& owner)>& drop);
  // Closes every channel and refuses new ones from now on.
  void CloseAll();
  // Channels open now (of `owner`; empty: all), counting those not yet attached.
  int open_count(const std::string& owner = "") const;
  // Waits until no channel is open or `deadline` passed; true when none is.
  bool WaitUntilNoneOpen(absl::Time deadline) const;

 private:
  struct Channel;
  void Run(Channel* channel, uint32_t caller_pid, absl::Time attach_deadline, Handler handler);
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StepChannelOptions options_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint64_t, std::unique_ptr<Channel>> open_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> finished_ ABSL_GUARDED_BY(mu_);  // threads that are done, to join
};

}  // namespace moe

#endif  // MOED_SERVER_STEP_CHANNELS_H_
