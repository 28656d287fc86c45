// ForwardBatcher: forwards that arrive close together on one key (a layer and a datatype) are
// merged into one step and each caller gets its own part back (Triton's dynamic batcher,
// hivemind's task pools). It knows nothing of gRPC or of the layer's maths: a member is a
// token count, a deadline and a cancelled() callback; the caller's `run` does the step.
//
// How a batch forms. The first member submitted on a key opens a batch and leads it: on its
// own thread it waits for others to join, then runs the merged step. It waits
//   - up to max_delay after the batch opened, but only when the key looks busy: its previous
//     merged step had more than one member or is still running (a lone caller that calls
//     again and again never waits; a burst of callers merges from its second step on);
//   - not at all once the batch holds max_tokens (a member that would pass it opens the next
//     batch) or once a member's deadline is closer than max_delay ("goes at once");
//   - and in any case until the key's previous batch finished running: batches of one key run
//     one at a time, in the order they opened, and keep taking members until they run.
// The leader then runs `run` on every member still in the batch and wakes them.
//
// Leaving. A member (not the leader) whose cancelled() turns true or whose deadline passes
// returns CANCELLED / DEADLINE_EXCEEDED at once (polled every few milliseconds); if its batch
// has not started it is dropped from it, otherwise the step runs with its rows and nobody
// reads them. The batch stays intact either way. A leader always runs its batch (the others
// wait on it), whatever its own caller does.
//
//   ForwardBatcher batcher(options);
//   auto member = std::make_shared<MyMember>();  // : BatchMember, with the request's data
//   member->tokens = 64; member->deadline = d; member->cancelled = [ctx] { ... };
//   absl::Status s = batcher.Submit("layer/FP32", member, [](const BatchMembers& batch) {
//     ... one step for all of batch, then each member's status and results ...
//   });
//   // s: the member's own status (set by run), or CANCELLED / DEADLINE_EXCEEDED if it left.
#ifndef MOED_SERVER_FORWARD_BATCHER_H_
#define MOED_SERVER_FORWARD_BATCHER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moe {

struct ForwardBatchingOptions {
  bool enabled = true;  // moed --forward_batching (on by default; --noforward_batching)
  // The longest a request waits for others before its batch runs (on an idle, busy-looking
  // key; see above). Zero: batches form only while the key's previous step runs.
  absl::Duration max_delay = absl::Microseconds(300);
  // The most tokens one merged step holds; a single request above it is not batched.
  int64_t max_tokens = 8192;
};

// One caller's request in a batch. The caller fills tokens, deadline and cancelled before
// Submit; `run` fills status (and the subclass's results) before the member is woken.
struct BatchMember {
  virtual ~BatchMember() = default;
  int64_t tokens = 0;
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be null; must be cheap and thread-safe
  absl::Status status;              // written by run
  absl::Duration queue_wait;        // submit to the start of its step, written by the batcher
 private:
  friend class ForwardBatcher;
  absl::Time submitted;
  bool done = false;  // ForwardBatcher::mu_
};

using BatchMembers = std::vector<std::shared_ptr<BatchMember>>;

class ForwardBatcher {
 public:
  explicit ForwardBatcher(ForwardBatchingOptions options) : options_(options) {}
  ForwardBatcher(const ForwardBatcher&) = delete;
  ForwardBatcher& operator=(const ForwardBatcher&) = delete;

  const ForwardBatchingOptions& options() const { return options_; }

  // Adds `member` to the open batch of `key` (or opens one) and returns its outcome: the
  // status `run` gave it, or CANCELLED / DEADLINE_EXCEEDED when it left first. `run` is
  // called on the leader's thread, without the batcher's lock, with the batch's members in
  // arrival order (never empty); it must set each member's status. Blocks until then.
  absl::Status Submit(const std::string& key, std::shared_ptr<BatchMember> member,
                      const std::function<void(const BatchMembers&)>& run);

  // Members in the batches of `key` that have not started (tests: a batch formed).
  int WaitingMembers(const std::string& key) const;

 private:
  struct Batch {
    uint64_t seq = 0;  // opening order within its key
    absl::Time opened;
    BatchMembers members;
    int64_t tokens = 0;
    bool go_now = false;   // full, or a member's deadline is close
    bool started = false;  // run was called: members no longer leave it
  };
  struct Key {
    std::shared_ptr<Batch> open;  // the batch new members join; null: none
    int waiting = 0;              // members of batches not started
    uint64_t next_seq = 0;        // seq of the next batch to open
    uint64_t run_seq = 0;         // seq of the batch allowed to run next
    bool running = false;
    bool busy = false;            // last merged step had more than one member
  };

  absl::Status Lead(Key& key, const std::shared_ptr<Batch>& batch, BatchMember& self,
                    const std::function<void(const BatchMembers&)>& run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Follow(Key& key, const std::shared_ptr<Batch>& batch, BatchMember& self)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetIfIdle(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ForwardBatchingOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Key> keys_ ABSL_GUARDED_BY(mu_);  // erased when idle
};

}  // namespace moe

#endif  // MOED_SERVER_FORWARD_BATCHER_H_
