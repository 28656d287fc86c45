#include "server/worker_rings.h"

#include <sys/random.h>
#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/status_convert.h"
#include "server/pid_namespace.h"
#include "transport/step_envelope.h"

namespace moe {
namespace {

// Room kept in a record for an answer's fields beside its tensor (losses, counts, timing).
constexpr uint64_t kAnswerFieldsBytes = 64 << 10;

absl::StatusOr<std::string> RandomRingName() {
  char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) return absl::InternalError("getrandom failed");
    got += static_cast<size_t>(n);
  }
  return absl::StrCat("/moed-worker-ring-", absl::BytesToHexString(absl::string_view(bytes, 16)));
}

void Log(int rank, absl::string_view what) {
  std::fprintf(stderr, "moed: worker %d: %s\n", rank, std::string(what).c_str());
}

}  // namespace

std::string BufferBytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);  // a buffer in memory always dumps
  std::string bytes;
  bytes.reserve(buffer.Length());
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return bytes;
}

bool IsRingChannelError(const absl::Status& status) {
  // Every status RingChannel / StepRing make themselves says so first; a worker's handler
  // never starts a message that way.
  return !status.ok() && (absl::StartsWith(status.message(), "ring channel") ||
                          absl::StartsWith(status.message(), "step ring"));
}

WorkerRings::WorkerRings(int rank, std::vector<std::unique_ptr<RingChannel>> channels)
    : rank_(rank) {
  absl::MutexLock lock(&mu_);
  max_payload_ = channels.empty() ? 0 : channels.front()->max_payload();
  channels_ = static_cast<int>(channels.size());
  free_ = std::move(channels);
}

std::shared_ptr<WorkerRings> WorkerRings::Open(int rank, int64_t generation, int64_t worker_pid,
                                               internal::Worker::Stub* stub,
                                               const WorkerRingOptions& options) {
  const std::string pid_namespace = PidNamespace();
  if (worker_pid <= 0 || pid_namespace.empty()) {
    Log(rank, "no step rings (the worker's pid or this process's pid namespace is unknown)");
    return nullptr;
  }
  RingChannelOptions ring_options;
  ring_options.ring_bytes = options.ring_bytes;
  std::vector<std::unique_ptr<RingChannel>> created;
  internal::OpenStepChannelsRequest request;
  request.set_generation(generation);
  request.set_caller_pid(getpid());
  request.set_caller_pid_namespace(pid_namespace);
  for (int i = 0; i < options.channels_per_worker; ++i) {
    absl::StatusOr<std::string> name = RandomRingName();
    absl::StatusOr<ShmObject> object =
        name.ok() ? ShmObject::CreateNamed(*name, RingChannel::RegionBytes(options.ring_bytes))
                  : absl::StatusOr<ShmObject>(name.status());
    absl::StatusOr<std::unique_ptr<RingChannel>> channel =
        object.ok() ? RingChannel::Create(*std::move(object), RingChannel::Role::kCaller,
                                          ring_options)
                    : absl::StatusOr<std::unique_ptr<RingChannel>>(object.status());
    if (!channel.ok()) {
      Log(rank, absl::StrCat("no step rings: ", channel.status().message()));
      return nullptr;  // the channels made so far unlink their names as they go
    }
    request.add_names((*channel)->name());
    created.push_back(*std::move(channel));
  }
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options.open_timeout));
  internal::OpenStepChannelsResponse response;
  const absl::Status opened = FromGrpcStatus(stub->OpenStepChannels(&context, request, &response));
  // The worker has attached (or never will): the names go now, whatever it answered.
  for (auto& channel : created) channel->object().Unlink().IgnoreError();
  if (!opened.ok()) {
    Log(rank, absl::StrCat("no step rings (OpenStepChannels: ", opened.ToString(), ")"));
    return nullptr;
  }
  std::vector<std::unique_ptr<RingChannel>> kept;
  std::string refused;
  for (size_t i = 0; i < created.size(); ++i) {
    const std::string error = static_cast<int>(i) < response.errors_size()
                                  ? response.errors(static_cast<int>(i))
                                  : "no answer for it";
    const uint32_t server = created[i]->PeerPid();
    if (!error.empty()) {
      refused = error;
    } else if (server != static_cast<uint32_t>(worker_pid)) {
      // Someone else took the server slot: never send it a step.
      refused = absl::StrCat("the server slot holds pid ", server, ", the worker joined as pid ",
                             worker_pid);
    } else {
      kept.push_back(std::move(created[i]));
    }
  }
  if (kept.empty()) {
    Log(rank, absl::StrCat("no step rings (refused: ", refused, ")"));
    return nullptr;
  }
  if (!refused.empty()) {
    Log(rank, absl::StrCat(kept.size(), " of ", created.size(), " step rings (refused: ",
                           refused, ")"));
  }
  return std::shared_ptr<WorkerRings>(new WorkerRings(rank, std::move(kept)));
}

size_t WorkerRings::free_channels() const {
  absl::MutexLock lock(&mu_);
  return free_.size();
}

std::optional<absl::StatusOr<std::string>> WorkerRings::Call(
    WorkerRingKind kind, const grpc::ByteBuffer& request, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  const uint64_t bytes = request.Length();
  if (kStepEnvelopeBytes + bytes > max_payload_ || 2 * bytes + kAnswerFieldsBytes > max_payload_) {
    return std::nullopt;  // a large inline tensor: gRPC (the answer may be as large)
  }
  std::unique_ptr<RingChannel> channel;
  {
    absl::MutexLock lock(&mu_);
    if (fell_back_ || free_.empty()) return std::nullopt;
    channel = std::move(free_.back());
    free_.pop_back();
  }
  absl::StatusOr<std::string> answer =
      channel->Call(EncodeStepEnvelope(static_cast<uint8_t>(kind), deadline - absl::Now(),
                                       BufferBytes(request)),
                    deadline, cancelled);
  Return(std::move(channel), answer.status());
  if (IsRingChannelError(answer.status()) && absl::IsDataLoss(answer.status())) {
    // A transport failure to the fan-out (the answer never came), as gRPC reports one.
    return absl::StatusOr<std::string>(absl::UnavailableError(answer.status().message()));
  }
  return answer;
}

void WorkerRings::Return(std::unique_ptr<RingChannel> channel, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (!IsRingChannelError(status)) {
    if (!fell_back_) free_.push_back(std::move(channel));
    return;
  }
  --channels_;
  if (absl::IsDeadlineExceeded(status) || absl::IsCancelled(status)) {
    // The worker may still answer on it: dropped; the others carry on.
    if (channels_ == 0 && !fell_back_) {
      fell_back_ = true;
      Log(rank_, "every step ring was given up after calls that passed their deadline or were "
                 "cancelled; gRPC until the next generation");
    }
    return;
  }
  if (!fell_back_) {
    fell_back_ = true;
    Log(rank_, absl::StrCat("step ring failed (", status.ToString(),
                            "); gRPC until the next generation"));
  }
  free_.clear();
  channels_ = 0;
}

}  // namespace moe
