// The front end's view of its workers: membership (Join, ranks, generations), liveness
// (a ping loop), the Setup of each generation, and fan-out of calls to every worker.
//
// Life of a generation: every rank slot filled by a live worker -> the setup thread bumps the
// generation, calls Worker.Setup on all workers in parallel (they rendezvous through the
// store under "g<generation>/"), runs the on_setup hook (the service re-creates its layers),
// then the pool is serving. A worker that misses pings for dead_after, whose process exited,
// or whose call failed and who then fails a quick ping, is dead: serving stops, every
// in-flight call is cancelled (callers see UNAVAILABLE), and the pool waits for a worker to
// join that rank again; then a new generation starts.
//
// Internal calls carry the cluster secret (server/cluster_secret.h): every stub's channel
// adds it.
//
//   WorkerPool pool(options, secret);
//   pool.set_on_setup([&](const WorkerSet& set) { return RecreateLayers(set); });
//   pool.Start();
//   ASSIGN_OR_RETURN(WorkerSet set, pool.Serving());
//   RETURN_IF_ERROR(pool.ForEachWorker(set, deadline, [&](int rank, Stub* stub,
//                                                         grpc::ClientContext* ctx) { ... }));
#ifndef MOED_SERVER_WORKER_POOL_H_
#define MOED_SERVER_WORKER_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/kept_threads.h"
#include "proto/moe.pb.h"
#include "proto/worker.grpc.pb.h"
#include "server/cluster_secret.h"
#include "server/worker_call.h"
#include "server/worker_rings.h"

namespace moe {

struct WorkerPoolOptions {
  int world_size = 1;
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  absl::Duration ping_timeout = absl::Seconds(1);
  absl::Duration dead_after = absl::Seconds(3);  // no answer for this long = dead
  absl::Duration setup_timeout = absl::Seconds(60);
  absl::Duration collective_timeout = absl::Seconds(30);  // passed to the workers
  // Step rings to the workers on this host (server/worker_rings.h), opened after each
  // generation's Setup.
  WorkerRingOptions rings;
};

// How ForEachWorker treats a fan-out.
struct FanOutOptions {
  // The call runs collectives on the workers: a failure that may have left ranks out of step
  // (partial success, or a transport error other than an overdue call) restarts the
  // generation (communicators rebuilt).
  bool collective = false;
  // Polled (every ~20 ms) while the calls run; when it returns true the calls are cancelled
  // (a public call whose client left, a service shutting down). Null: never.
  std::function<bool()> cancelled;
};

// What ForEachWorker learned beyond its status.
struct FanOutOutcome {
  // The call failed but may have taken effect on some workers: at least one rank succeeded,
  // or a rank's answer never came (transport error, overdue).
  bool partial = false;
  // Some rank's call passed `deadline` while its worker still answers pings: the worker may
  // still be running it (a synchronous handler does not stop when its caller gives up).
  // Every other failure, if any, was overdue too; then nothing was restarted. The caller
  // must wait for the workers to finish before it sends them the layer's next call.
  bool overdue = false;
};

// The workers of one generation, by rank.
struct WorkerSet {
  int64_t generation = 0;
  std::vector<std::shared_ptr<internal::Worker::Stub>> stubs;
  // The stubs' channels, for the step calls that send borrowed bytes (server/worker_call.h).
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  // Every worker joined with a loopback address (127.x, ::1, localhost): they run on moed's
  // host and share its /dev/shm, so moed relays step tensors to them through shared memory
  // (server/relay_pool.h).
  bool local = false;
  // Per rank, the generation's step rings to that worker (null: gRPC only: another host,
  // --worker_ring=false, or refused).
  std::vector<std::shared_ptr<WorkerRings>> rings;
  // Whether the pool cancelled an in-flight call's context (valid while the pool lives).
  std::function<bool(const grpc::ClientContext*)> call_cancelled;
  int size() const { return static_cast<int>(stubs.size()); }
  // How a step call reaches rank r (server/worker_call.h).
  WorkerRoute Route(int r) const {
    return WorkerRoute{channels[r], r < static_cast<int>(rings.size()) ? rings[r].get() : nullptr,
                       call_cancelled};
  }
};

class WorkerPool {
 public:
  using WorkerFn =
      std::function<absl::Status(int rank, internal::Worker::Stub* stub, grpc::ClientContext*)>;

  WorkerPool(WorkerPoolOptions options, ClusterSecret secret);
  ~WorkerPool();  // Stop()

  // Cancels in-flight calls and joins the heartbeat and setup threads: after it, the pool
  // calls no hook (on_setup, on_serving_changed) any more. Idempotent. Whoever owns the
  // hooks' targets calls it before destroying them.
  void Stop();

  // Called on the setup thread after every worker's Setup succeeded, before serving.
  void set_on_setup(std::function<absl::Status(const WorkerSet&)> fn) { on_setup_ = fn; }
  // Called on the setup thread (no lock held) when generation `g` starts forming, before its
  // Setup calls: the rendezvous store drops the keys of earlier generations.
  // Workers seen dying (a live worker marked dead) since the start: metrics.
  int64_t worker_deaths() const { return worker_deaths_.load(); }
  void set_on_new_generation(std::function<void(int64_t g)> fn) { on_new_generation_ = fn; }
  // Called with the new state whenever serving changes (health status).
  void set_on_serving_changed(std::function<void(bool)> fn) { on_serving_changed_ = fn; }
  void Start();

  // Coordinator.Join: assigns a rank (see worker.proto JoinRequest). FAILED_PRECONDITION when
  // the rank asked for, or the address, is held by a live worker (one that answers a ping as
  // the process that joined there): a replayed Join cannot displace a worker.
  absl::StatusOr<internal::JoinResponse> Join(const internal::JoinRequest& request);

  // The current generation's workers when serving; UNAVAILABLE saying why not otherwise.
  absl::StatusOr<WorkerSet> Serving() const;
  bool serving() const;
  int world_size() const { return options_.world_size; }

  // Calls fn for every rank in parallel, each with a context whose deadline is `deadline`.
  // Returns OK when all succeed. Otherwise: UNAVAILABLE naming the worker when a worker of
  // `set` died or the generation changed meanwhile; else the most telling worker error
  // (a non-transport code before UNAVAILABLE/DEADLINE_EXCEEDED/CANCELLED), prefixed by
  // its rank. With `collective`, a failure that may have left ranks out of step (partial
  // success, or a transport error) also restarts the generation (communicators rebuilt).
  // `partial` (optional) is set when the call failed but may have taken effect on some
  // workers: at least one rank succeeded, or a rank's answer never came (transport error).
  // A worker's ABORTED is an answer (the engine's "another rank failed"), not transport.
  absl::Status ForEachWorker(const WorkerSet& set, absl::Time deadline, const WorkerFn& fn,
                             bool collective, bool* partial = nullptr);
  // The same with options: a call that passes `deadline` on a live worker (every failure
  // overdue) is DEADLINE_EXCEEDED with outcome->overdue set and restarts nothing, also when
  // collective: a step that takes long is not a broken communicator. The caller waits for
  // the workers (e.g. a call that takes the layer's slot on each) before the layer's next
  // collective.
  absl::Status ForEachWorker(const WorkerSet& set, absl::Time deadline, const WorkerFn& fn,
                             const FanOutOptions& options, FanOutOutcome* outcome);

  // Marks `rank` dead (a process exit seen by the embedded launcher, a failed ping).
  void MarkDead(int rank, const std::string& why);
  // Forces a new generation with the same workers (communicators rebuilt, layers re-created).
  void Restart(const std::string& why);

  std::vector<v1::WorkerStatus> WorkerStatuses() const;
  // The largest PingResponse.deferred_wgrad_fraction the workers reported; empty while none did.
  std::optional<double> LargestDeferredWgradFraction() const;
  int64_t generation() const;
  std::string message() const;  // why not serving (empty when serving)

 private:
  struct Slot {
    bool filled = false;  // a worker joined this rank at some point
    bool alive = false;
    std::string address;
    std::string device;
    int64_t pid = 0;
    std::shared_ptr<grpc::Channel> channel;
    std::shared_ptr<internal::Worker::Stub> stub;  // on `channel`
    absl::Time last_seen;
    std::string error;
    int64_t memory_bytes = 0;
    int64_t peak_memory_bytes = 0;
    int64_t memory_capacity_bytes = 0;  // PingResponse.memory_capacity_bytes
    std::optional<double> deferred_wgrad_fraction;  // PingResponse.deferred_wgrad_fraction
  };

  // Appends every slot's stub and channel to *set and says whether all are on this host.
  void AddSlotsLocked(WorkerSet* set) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ForEachWorker's steps (worker_pool_fanout.cc). Counts of a fan-out's failed ranks: all, by
  // transport (the answer never came), overdue (transport, past the deadline, on a worker that
  // answers pings).
  struct FanOutFailures {
    int failed = 0;
    int transport = 0;
    int overdue = 0;
  };
  // UNAVAILABLE when `set` is not the generation being served (or set up).
  absl::Status NotServingLocked(const WorkerSet& set) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A context per rank with `deadline`, registered in in_flight_ (CancelInFlightLocked reaches
  // it) until EndCalls.
  absl::Status StartCalls(const WorkerSet& set, absl::Time deadline,
                          std::vector<std::unique_ptr<grpc::ClientContext>>* contexts);
  void EndCalls(const std::vector<std::unique_ptr<grpc::ClientContext>>& contexts);
  // How long since the heartbeat (or an answered call) last heard from `rank`.
  absl::Duration SilentFor(int rank) const ABSL_LOCKS_EXCLUDED(mu_);
  // Counts the failures. A rank whose call ran to `deadline` is overdue, or dead when the
  // heartbeat heard nothing from it for dead_after (no ping: the caller's error comes at the
  // deadline). A rank whose call failed otherwise in transport is marked dead when a quick ping
  // cannot reach it, or times out and the heartbeat heard nothing from it for dead_after (the
  // pings of all such ranks at once, none once `set` is no longer served).
  FanOutFailures CountFailures(const WorkerSet& set, const std::vector<absl::Status>& results,
                               const std::vector<absl::Time>& ended, absl::Time deadline);
  // UNAVAILABLE naming a dead worker of `set`, or when `set` is no longer served.
  absl::Status CheckWorkersOf(const WorkerSet& set) const;
  // Rank `rank`'s heartbeat: a ping every heartbeat_interval, one at a time, each allowed to
  // answer until the worker was silent for dead_after (at least ping_timeout); a worker whose
  // ping failed after dead_after of silence is dead.
  void PingLoop(int rank);
  // A rank that answered its call is alive: counts as heard from at `ended` (a worker whose
  // CPU the steps saturate may answer its steps sooner than a ping).
  void NoteAnswered(const WorkerSet& set, const std::vector<absl::Status>& results,
                    const std::vector<absl::Time>& ended) ABSL_LOCKS_EXCLUDED(mu_);
  void SetupLoop();
  absl::Status RunSetup(int64_t generation, const WorkerSet& set);
  void SetServingLocked(bool serving, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CancelInFlightLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A quick ping of one address; OK if it answered.
  absl::Status QuickPing(internal::Worker::Stub* stub, absl::Duration timeout,
                         int64_t* pid = nullptr) const;
  // True when the worker behind `stub` answers a quick ping as process `pid` (0: any).
  bool AnswersAs(internal::Worker::Stub* stub, int64_t pid) const;
  std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) const;
  // The step rings of `generation` to every worker of `set` on this host (after Setup).
  void OpenRings(int64_t generation, const WorkerSet& set);
  // Whether `context` (of a call in flight) was cancelled by the pool.
  bool CallCancelled(const grpc::ClientContext* context) const;
  // TryCancel of `contexts`, remembered for CallCancelled.
  void CancelCalls(const std::vector<std::unique_ptr<grpc::ClientContext>>& contexts);

  // ForEachWorker's calls to ranks 1.. (rank 0's runs on the calling thread).
  KeptThreads fan_out_threads_;
  const WorkerPoolOptions options_;
  const ClusterSecret secret_;
  std::function<absl::Status(const WorkerSet&)> on_setup_;
  std::function<void(int64_t)> on_new_generation_;
  std::atomic<int64_t> worker_deaths_{0};
  std::function<void(bool)> on_serving_changed_;

  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool need_setup_ ABSL_GUARDED_BY(mu_) = true;
  bool in_setup_ ABSL_GUARDED_BY(mu_) = false;  // on_setup_ may fan out while set up
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string message_ ABSL_GUARDED_BY(mu_);
  std::set<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(mu_);
  // Those of in_flight_ that were cancelled (ring calls poll it: CallCancelled).
  std::set<const grpc::ClientContext*> cancelled_ ABSL_GUARDED_BY(mu_);
  // The current generation's step rings, by rank (AddSlotsLocked hands them out).
  std::vector<std::shared_ptr<WorkerRings>> rings_ ABSL_GUARDED_BY(mu_);
  // Each rank's heartbeat ping in flight (null: none), cancelled by Stop.
  std::vector<grpc::ClientContext*> pings_in_flight_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> ping_threads_;  // PingLoop of each rank
  std::thread setup_thread_;
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_POOL_H_
