#include "server/worker_ring_server.h"

#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/pid_namespace.h"
#include "transport/step_envelope.h"

namespace moe {
namespace {

constexpr absl::Duration kIdleCheckInterval = absl::Milliseconds(250);

}  // namespace

WorkerRingServer::~WorkerRingServer() {
  std::list<std::unique_ptr<Served>> served;
  {
    absl::MutexLock lock(&mu_);
    served.swap(served_);
  }
  for (auto& s : served) s->channel->Stop();
  for (auto& s : served) s->thread.join();
}

int WorkerRingServer::serving() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& s : served_) n += s->done.load() ? 0 : 1;
  return n;
}

absl::StatusOr<std::unique_ptr<RingChannel>> WorkerRingServer::Attach(
    const std::string& name, const internal::OpenStepChannelsRequest& request) const {
  if (!absl::StartsWith(name, "/moed-worker-ring-")) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a step ring name"));
  }
  const std::string pid_namespace = PidNamespace();
  if (pid_namespace.empty() || pid_namespace != request.caller_pid_namespace()) {
    return absl::FailedPreconditionError(
        absl::StrCat("moed's pid namespace ", request.caller_pid_namespace(),
                     " is not this worker's (", pid_namespace, ")"));
  }
  absl::StatusOr<ShmObject> object = ShmObject::OpenNamed(name);
  if (!object.ok()) return object.status();
  // An idle channel's thread wakes once per interval to see whether moed still lives: seldom
  // here (moed's side, which waits for answers, checks every 20 ms).
  RingChannelOptions options;
  options.peer_check_interval = kIdleCheckInterval;
  options.max_spin = max_spin_;
  absl::StatusOr<std::unique_ptr<RingChannel>> channel =
      RingChannel::Attach(*std::move(object), RingChannel::Role::kServer, options);
  if (!channel.ok()) return channel.status();
  const uint32_t caller = (*channel)->PeerPid();
  if (request.caller_pid() <= 0 || caller != static_cast<uint64_t>(request.caller_pid())) {
    // Dropped at once: its caller slot is not the process that asked.
    return absl::PermissionDeniedError(absl::StrCat(
        name, ": the caller slot holds pid ", caller, ", not moed's ", request.caller_pid()));
  }
  return channel;
}

void WorkerRingServer::Open(const internal::OpenStepChannelsRequest& request,
                            internal::OpenStepChannelsResponse* response) {
  std::list<std::unique_ptr<Served>> ended;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = served_.begin(); it != served_.end();) {
      if ((*it)->done.load() || (*it)->generation < request.generation()) {
        (*it)->channel->Stop();
        ended.push_back(std::move(*it));
        it = served_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& s : ended) s->thread.join();  // within one peer check (20 ms) or one step
  for (const std::string& name : request.names()) {
    absl::StatusOr<std::unique_ptr<RingChannel>> channel = Attach(name, request);
    if (!channel.ok()) {
      std::fprintf(stderr, "moe-worker: step ring refused: %s\n",
                   channel.status().ToString().c_str());
      response->add_errors(channel.status().ToString());
      continue;
    }
    response->add_errors("");
    auto served = std::make_unique<Served>();
    served->generation = request.generation();
    served->channel = *std::move(channel);
    Served* s = served.get();
    absl::MutexLock lock(&mu_);
    served_.push_back(std::move(served));
    s->thread = std::thread([this, s] { ServeChannel(s); });
  }
}

absl::StatusOr<std::string> WorkerRingServer::Answer(absl::string_view record) const {
  absl::StatusOr<StepEnvelope> envelope = DecodeStepEnvelope(record);
  if (!envelope.ok()) return envelope.status();
  // Relative, as gRPC's timeout header: this clock at receipt plus what was left when sent.
  return handler_(envelope->kind, absl::Now() + envelope->deadline, envelope->body);
}

void WorkerRingServer::ServeChannel(Served* served) const {
  const absl::Status status =
      served->channel->Serve([this](absl::string_view record) { return Answer(record); });
  if (!status.ok() && !absl::IsUnavailable(status)) {
    std::fprintf(stderr, "moe-worker: step ring %s ended: %s\n", served->channel->name().c_str(),
                 status.ToString().c_str());
  }
  served->done.store(true);
}

}  // namespace moe
