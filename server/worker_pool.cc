#include "server/worker_pool.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"
#include "transport/bulk_transport.h"

namespace moe {
namespace {

// "127.0.0.1:41234", "localhost:41234", "[::1]:41234": a worker on this host.
bool IsLoopbackAddress(absl::string_view address) {
  return absl::StartsWith(address, "127.") || absl::StartsWith(address, "localhost:") ||
         absl::StartsWith(address, "[::1]:");
}

}  // namespace

void WorkerPool::AddSlotsLocked(WorkerSet* set) const {
  set->rings = rings_;
  set->rings.resize(slots_.size());
  set->call_cancelled = [this](const grpc::ClientContext* context) {
    return CallCancelled(context);
  };
  set->local = !slots_.empty();
  for (const Slot& slot : slots_) {
    set->stubs.push_back(slot.stub);
    set->channels.push_back(slot.channel);
    set->local = set->local && IsLoopbackAddress(slot.address);
  }
}

std::shared_ptr<grpc::Channel> WorkerPool::MakeChannel(const std::string& address) const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT_MAX);
  args.SetMaxSendMessageSize(INT_MAX);
  // Reconnect quickly after a worker restarts on the same address.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  SetBulkTransportArgs(&args);
  return secret_.Channel(address, args);
}

WorkerPool::WorkerPool(WorkerPoolOptions options, ClusterSecret secret)
    : options_(std::move(options)), secret_(std::move(secret)) {
  absl::MutexLock lock(&mu_);
  slots_.resize(options_.world_size);
  message_ = absl::StrCat("waiting for ", options_.world_size, " worker(s) to join");
}

WorkerPool::~WorkerPool() { Stop(); }

void WorkerPool::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    CancelInFlightLocked();
    for (grpc::ClientContext* ping : pings_in_flight_) {
      if (ping != nullptr) ping->TryCancel();
    }
  }
  for (std::thread& t : ping_threads_) t.join();
  ping_threads_.clear();
  if (setup_thread_.joinable()) setup_thread_.join();
}

void WorkerPool::Start() {
  const int ranks = options_.world_size;
  {
    absl::MutexLock lock(&mu_);
    pings_in_flight_.assign(ranks, nullptr);
  }
  for (int r = 0; r < ranks; ++r) ping_threads_.emplace_back([this, r] { PingLoop(r); });
  setup_thread_ = std::thread([this] { SetupLoop(); });
}

absl::Status WorkerPool::QuickPing(internal::Worker::Stub* stub, absl::Duration timeout,
                                   int64_t* pid) const {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  internal::PingRequest request;
  internal::PingResponse response;
  absl::Status status = FromGrpcStatus(stub->Ping(&context, request, &response));
  if (pid != nullptr) *pid = response.pid();
  return status;
}

bool WorkerPool::AnswersAs(internal::Worker::Stub* stub, int64_t pid) const {
  int64_t answered = 0;
  if (!QuickPing(stub, absl::Milliseconds(500), &answered).ok()) return false;
  return pid == 0 || answered == pid;
}

absl::StatusOr<internal::JoinResponse> WorkerPool::Join(const internal::JoinRequest& request) {
  if (request.address().empty()) return absl::InvalidArgumentError("address: required");
  const int size = options_.world_size;
  int rank = request.requested_rank();
  // The live workers that the join would displace: the rank's holder, and whoever holds the
  // address (a live worker's address replayed from GetStatus must not take its place).
  std::shared_ptr<internal::Worker::Stub> previous, holder;
  int64_t previous_pid = 0, holder_pid = 0;
  int holder_rank = -1;
  {
    absl::MutexLock lock(&mu_);
    if (rank >= size || rank < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat("requested_rank: ", rank, " is outside [0, ", size, ") (or -1)"));
    }
    for (int r = 0; r < size; ++r) {
      if (slots_[r].alive && slots_[r].address == request.address()) {
        holder = slots_[r].stub;
        holder_pid = slots_[r].pid;
        holder_rank = r;
      }
    }
    if (rank == -1) {
      for (int r = 0; r < size && rank == -1; ++r) {
        if (!slots_[r].alive || r == holder_rank) rank = r;
      }
      if (rank == -1) {
        return absl::ResourceExhaustedError(
            absl::StrCat("all ", size, " ranks are held by live workers"));
      }
    }
    if (slots_[rank].alive && rank != holder_rank) {
      previous = slots_[rank].stub;
      previous_pid = slots_[rank].pid;
    }
  }
  // A live worker answers a ping as the process that joined: then the join is refused. One
  // that does not (gone, stalled, or another process now at its address: a restart) is
  // replaced. The same process joining again while it still counts as alive (it missed pings
  // that the front end meanwhile got through) is refused too and retries later.
  if (holder != nullptr && AnswersAs(holder.get(), holder_pid)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "address ", request.address(), " is held by the live worker of rank ", holder_rank));
  }
  if (previous != nullptr && AnswersAs(previous.get(), previous_pid)) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " is held by a live worker"));
  }
  std::shared_ptr<grpc::Channel> channel = MakeChannel(request.address());
  std::shared_ptr<internal::Worker::Stub> stub = internal::Worker::NewStub(channel);
  absl::MutexLock lock(&mu_);
  Slot& slot = slots_[rank];
  const std::shared_ptr<internal::Worker::Stub> expected = rank == holder_rank ? holder : previous;
  if (slot.alive && slot.stub != expected) {
    return absl::AbortedError(absl::StrCat("rank ", rank, " was taken concurrently; retry"));
  }
  if (holder_rank >= 0 && holder_rank != rank && slots_[holder_rank].stub == holder &&
      slots_[holder_rank].alive) {
    slots_[holder_rank].alive = false;
    slots_[holder_rank].error =
        absl::StrCat("its address ", request.address(), " was joined again by rank ", rank);
  }
  slot.filled = true;
  slot.alive = true;
  slot.address = request.address();
  slot.device = request.device();
  slot.pid = request.pid();
  slot.channel = std::move(channel);
  slot.stub = std::move(stub);
  slot.last_seen = absl::Now();
  slot.error.clear();
  need_setup_ = true;
  CancelInFlightLocked();
  SetServingLocked(false, absl::StrCat("worker ", rank, " (", request.address(),
                                       ") joined; rebuilding communicators"));
  internal::JoinResponse response;
  response.set_rank(rank);
  response.set_world_size(size);
  response.set_generation(generation_);
  return response;
}

absl::StatusOr<WorkerSet> WorkerPool::Serving() const {
  absl::MutexLock lock(&mu_);
  if (!serving_) return absl::UnavailableError(absl::StrCat("not serving: ", message_));
  WorkerSet set;
  set.generation = generation_;
  AddSlotsLocked(&set);
  return set;
}

bool WorkerPool::serving() const {
  absl::MutexLock lock(&mu_);
  return serving_;
}

int64_t WorkerPool::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

std::string WorkerPool::message() const {
  absl::MutexLock lock(&mu_);
  return serving_ ? "" : message_;
}

void WorkerPool::SetServingLocked(bool serving, const std::string& message) {
  const bool changed = serving != serving_;
  serving_ = serving;
  message_ = message;
  if (changed && on_serving_changed_) on_serving_changed_(serving);
}

void WorkerPool::CancelInFlightLocked() {
  for (grpc::ClientContext* context : in_flight_) {
    context->TryCancel();
    cancelled_.insert(context);
  }
}

bool WorkerPool::CallCancelled(const grpc::ClientContext* context) const {
  absl::MutexLock lock(&mu_);
  return cancelled_.count(context) > 0;
}

void WorkerPool::CancelCalls(const std::vector<std::unique_ptr<grpc::ClientContext>>& contexts) {
  absl::MutexLock lock(&mu_);
  for (auto& context : contexts) {
    context->TryCancel();
    cancelled_.insert(context.get());
  }
}

void WorkerPool::OpenRings(int64_t generation, const WorkerSet& set) {
  if (!options_.rings.enabled) return;
  std::vector<std::shared_ptr<WorkerRings>> rings(set.size());
  for (int r = 0; r < set.size(); ++r) {
    int64_t pid = 0;
    {
      absl::MutexLock lock(&mu_);
      if (generation_ != generation || stopping_) return;
      // On this host as the relay decides it (a loopback address), else gRPC only.
      if (!IsLoopbackAddress(slots_[r].address)) continue;
      pid = slots_[r].pid;
    }
    rings[r] = WorkerRings::Open(r, generation, pid, set.stubs[r], options_.rings);
  }
  absl::MutexLock lock(&mu_);
  if (generation_ == generation) rings_ = std::move(rings);
}

void WorkerPool::MarkDead(int rank, const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (rank < 0 || rank >= static_cast<int>(slots_.size()) || !slots_[rank].alive) return;
  Slot& slot = slots_[rank];
  slot.alive = false;
  slot.error = why;
  ++worker_deaths_;
  need_setup_ = true;
  CancelInFlightLocked();
  SetServingLocked(false, absl::StrCat("worker ", rank, " (", slot.address, ") gone: ", why));
}

void WorkerPool::Restart(const std::string& why) {
  absl::MutexLock lock(&mu_);
  need_setup_ = true;
  CancelInFlightLocked();
  SetServingLocked(false, absl::StrCat("rebuilding communicators: ", why));
}

void WorkerPool::PingLoop(int rank) {
  while (true) {
    std::shared_ptr<internal::Worker::Stub> stub;
    grpc::ClientContext context;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.heartbeat_interval)) return;
      const Slot& slot = slots_[rank];
      if (!slot.alive) continue;
      stub = slot.stub;
      // The answer may come as late as the worker may stay silent: a busy worker (its CPU
      // saturated by steps, or the host's by other processes) that answers within
      // dead_after is alive. A stopped one's ping fails when its silence reaches dead_after.
      const absl::Time now = absl::Now();
      context.set_deadline(
          absl::ToChronoTime(std::max(slot.last_seen + options_.dead_after,
                                      now + options_.ping_timeout)));
      pings_in_flight_[rank] = &context;
    }
    internal::PingRequest request;
    internal::PingResponse response;
    const grpc::Status status = stub->Ping(&context, request, &response);
    std::string dead;
    {
      absl::MutexLock lock(&mu_);
      pings_in_flight_[rank] = nullptr;
      if (stopping_) return;
      Slot& slot = slots_[rank];
      if (slot.stub != stub || !slot.alive) continue;
      const absl::Time now = absl::Now();
      if (status.ok()) {
        slot.last_seen = now;
        slot.memory_bytes = response.memory_bytes();
        slot.peak_memory_bytes = response.peak_memory_bytes();
        slot.memory_capacity_bytes = response.memory_capacity_bytes();
        slot.deferred_wgrad_fraction =
            response.has_deferred_wgrad_fraction()
                ? std::optional<double>(response.deferred_wgrad_fraction())
                : std::nullopt;
        if (!response.device().empty()) slot.device = response.device();
      } else if (now - slot.last_seen >= options_.dead_after) {
        dead = absl::StrCat("no answer to pings for ", absl::FormatDuration(now - slot.last_seen),
                            " (", status.error_message(), ")");
      }
    }
    if (!dead.empty()) MarkDead(rank, dead);
  }
}

void WorkerPool::NoteAnswered(const WorkerSet& set, const std::vector<absl::Status>& results,
                              const std::vector<absl::Time>& ended) {
  absl::MutexLock lock(&mu_);
  for (int r = 0; r < set.size() && r < static_cast<int>(slots_.size()); ++r) {
    Slot& slot = slots_[r];
    if (results[r].ok() && slot.alive && slot.stub == set.stubs[r]) {
      slot.last_seen = std::max(slot.last_seen, ended[r]);
    }
  }
}

void WorkerPool::SetupLoop() {
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stopping_) return true;
    if (!need_setup_) return false;
    for (const Slot& slot : slots_) {
      if (!slot.alive) return false;
    }
    return true;
  };
  while (true) {
    int64_t generation;
    WorkerSet set;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      need_setup_ = false;
      rings_.clear();  // the old generation's close once its last WorkerSet is gone
      generation = ++generation_;
      set.generation = generation;
      AddSlotsLocked(&set);
      message_ = absl::StrCat("setting up generation ", generation);
      in_setup_ = true;
    }
    if (on_new_generation_) on_new_generation_(generation);
    absl::Status status = RunSetup(generation, set);
    absl::MutexLock lock(&mu_);
    in_setup_ = false;
    if (generation_ != generation || need_setup_) continue;  // membership changed meanwhile
    if (status.ok()) {
      SetServingLocked(true, "");
    } else {
      message_ = absl::StrCat("setup of generation ", generation, " failed: ", status.message());
      need_setup_ = true;  // retried after a pause (a dead worker is found by the pings)
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Seconds(1));
    }
  }
}

absl::Status WorkerPool::RunSetup(int64_t generation, const WorkerSet& set) {
  std::vector<absl::Status> results(set.size());
  // Each worker's Setup call while it runs (guarded by mu_): when one fails, the others are
  // cancelled, since they wait in the rendezvous for the failed one until setup_timeout (60 s;
  // seen after a cut link: one worker's Setup failed, the other's hung for the whole timeout
  // in Gloo's connectFullMesh); the next generation is then tried after a pause.
  std::vector<grpc::ClientContext*> running(set.size(), nullptr);
  std::vector<std::thread> threads;
  for (int r = 0; r < set.size(); ++r) {
    threads.emplace_back([&, r] {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + options_.setup_timeout));
      internal::SetupRequest request;
      request.set_generation(generation);
      request.set_rank(r);
      request.set_world_size(set.size());
      request.set_store_prefix(absl::StrCat("g", generation, "/"));
      request.set_collective_timeout_ms(absl::ToInt64Milliseconds(options_.collective_timeout));
      internal::SetupResponse response;
      {
        // Registered so that a membership change or shutdown cancels a setup in progress.
        absl::MutexLock lock(&mu_);
        if (stopping_ || generation_ != generation) {
          results[r] = absl::CancelledError("setup superseded");
          return;
        }
        in_flight_.insert(&context);
        running[r] = &context;
      }
      absl::Status result = FromGrpcStatus(set.stubs[r]->Setup(&context, request, &response));
      absl::MutexLock lock(&mu_);
      running[r] = nullptr;
      in_flight_.erase(&context);
      cancelled_.erase(&context);
      results[r] = result;
      if (!result.ok()) {
        for (grpc::ClientContext* other : running) {
          if (other != nullptr) other->TryCancel();
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // The first failure that is not a cancellation caused by another's (that one names why).
  int failed = -1;
  for (int r = 0; r < set.size(); ++r) {
    if (!results[r].ok() &&
        (failed < 0 || (results[failed].code() == absl::StatusCode::kCancelled &&
                        results[r].code() != absl::StatusCode::kCancelled))) {
      failed = r;
    }
  }
  if (failed >= 0) {
    std::fprintf(stderr, "moed: setup of generation %lld failed: worker %d: %s\n",
                 static_cast<long long>(generation), failed,
                 std::string(results[failed].message()).c_str());
    return absl::Status(results[failed].code(),
                        absl::StrCat("worker ", failed, " Setup: ", results[failed].message()));
  }
  OpenRings(generation, set);
  // Layers are re-created while still not serving (in_setup_): steps cannot slip in.
  if (on_setup_) {
    absl::Status status = on_setup_(set);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

std::optional<double> WorkerPool::LargestDeferredWgradFraction() const {
  absl::MutexLock lock(&mu_);
  std::optional<double> largest;
  for (const Slot& slot : slots_) {
    if (!slot.deferred_wgrad_fraction.has_value()) continue;
    largest = std::max(largest.value_or(0.0), *slot.deferred_wgrad_fraction);
  }
  return largest;
}

std::vector<v1::WorkerStatus> WorkerPool::WorkerStatuses() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::WorkerStatus> out;
  const absl::Time now = absl::Now();
  for (int r = 0; r < static_cast<int>(slots_.size()); ++r) {
    const Slot& slot = slots_[r];
    v1::WorkerStatus status;
    status.set_rank(r);
    status.set_address(slot.address);
    status.set_device(slot.device);
    status.set_alive(slot.alive);
    status.set_memory_bytes(slot.memory_bytes);
    status.set_peak_memory_bytes(slot.peak_memory_bytes);
    status.set_memory_capacity_bytes(slot.memory_capacity_bytes);
    if (slot.deferred_wgrad_fraction.has_value()) {
      status.set_deferred_wgrad_fraction(*slot.deferred_wgrad_fraction);
    }
    status.set_last_seen_ms_ago(slot.filled ? absl::ToInt64Milliseconds(now - slot.last_seen) : -1);
    status.set_error(slot.filled ? slot.error : "not joined yet");
    status.set_pid(slot.pid);
    out.push_back(status);
  }
  return out;
}

}  // namespace moe
