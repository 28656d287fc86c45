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

WorkerRings::WorkerRings(Peer peer, std::vector<std::unique_ptr<RingChannel>> channels)
    : peer_(std::move(peer)) {
  absl::MutexLock lock(&mu_);
  max_payload_ = channels.empty() ? 0 : channels.front()->max_payload();
  channels_ = static_cast<int>(channels.size());
  free_ = std::move(channels);
}

WorkerRings::~WorkerRings() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (refill_call_ != nullptr) refill_call_->TryCancel();
  }
  if (refill_thread_.joinable()) refill_thread_.join();
}

std::vector<std::unique_ptr<RingChannel>> WorkerRings::OpenChannels(
    const Peer& peer, int count, grpc::ClientContext* context, std::string* why) {
  std::vector<std::unique_ptr<RingChannel>> kept;
  const std::string pid_namespace = PidNamespace();
  if (peer.worker_pid <= 0 || pid_namespace.empty() || peer.stub == nullptr) {
    *why = "the worker's pid or this process's pid namespace is unknown";
    return kept;
  }
  RingChannelOptions ring_options;
  ring_options.ring_bytes = peer.options.ring_bytes;
  ring_options.max_spin = peer.options.max_spin;
  std::vector<std::unique_ptr<RingChannel>> created;
  internal::OpenStepChannelsRequest request;
  request.set_generation(peer.generation);
  request.set_caller_pid(getpid());
  request.set_caller_pid_namespace(pid_namespace);
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<std::string> name = RandomRingName();
    absl::StatusOr<ShmObject> object =
        name.ok() ? ShmObject::CreateNamed(*name, RingChannel::RegionBytes(ring_options.ring_bytes))
                  : absl::StatusOr<ShmObject>(name.status());
    absl::StatusOr<std::unique_ptr<RingChannel>> channel =
        object.ok() ? RingChannel::Create(*std::move(object), RingChannel::Role::kCaller,
                                          ring_options)
                    : absl::StatusOr<std::unique_ptr<RingChannel>>(object.status());
    if (!channel.ok()) {
      *why = std::string(channel.status().message());
      return kept;  // the channels made so far unlink their names as they go
    }
    request.add_names((*channel)->name());
    created.push_back(*std::move(channel));
  }
  context->set_deadline(absl::ToChronoTime(absl::Now() + peer.options.open_timeout));
  internal::OpenStepChannelsResponse response;
  const absl::Status opened =
      FromGrpcStatus(peer.stub->OpenStepChannels(context, request, &response));
  // The worker has attached (or never will): the names go now, whatever it answered.
  for (auto& channel : created) channel->object().Unlink().IgnoreError();
  if (!opened.ok()) {
    *why = absl::StrCat("OpenStepChannels: ", opened.ToString());
    return kept;
  }
  for (size_t i = 0; i < created.size(); ++i) {
    const std::string error = static_cast<int>(i) < response.errors_size()
                                  ? response.errors(static_cast<int>(i))
                                  : "no answer for it";
    const uint32_t server = created[i]->PeerPid();
    if (!error.empty()) {
      *why = error;
    } else if (server != static_cast<uint32_t>(peer.worker_pid)) {
      // Someone else took the server slot: never send it a step.
      *why = absl::StrCat("the server slot holds pid ", server, ", the worker joined as pid ",
                          peer.worker_pid);
    } else {
      kept.push_back(std::move(created[i]));
    }
  }
  return kept;
}

std::shared_ptr<WorkerRings> WorkerRings::Open(int rank, int64_t generation, int64_t worker_pid,
                                               std::shared_ptr<internal::Worker::Stub> stub,
                                               const WorkerRingOptions& options) {
  Peer peer{rank, generation, worker_pid, std::move(stub), options};
  grpc::ClientContext context;
  std::string why;
  std::vector<std::unique_ptr<RingChannel>> kept =
      OpenChannels(peer, options.channels_per_worker, &context, &why);
  if (kept.empty()) {
    Log(rank, absl::StrCat("no step rings (", why, ")"));
    return nullptr;
  }
  if (!why.empty()) {
    Log(rank, absl::StrCat(kept.size(), " of ", options.channels_per_worker,
                           " step rings (refused: ", why, ")"));
  }
  return std::shared_ptr<WorkerRings>(new WorkerRings(std::move(peer), std::move(kept)));
}

bool WorkerRings::RefillDue() const { return stopping_ || missing_ > 0; }

void WorkerRings::Refill() {
  for (;;) {
    grpc::ClientContext context;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &WorkerRings::RefillDue));
      if (stopping_ || fell_back_ || refill_failed_) return;
      refill_call_ = &context;
    }
    std::string why;
    std::vector<std::unique_ptr<RingChannel>> opened = OpenChannels(peer_, 1, &context, &why);
    absl::MutexLock lock(&mu_);
    refill_call_ = nullptr;
    if (stopping_) return;
    if (opened.empty()) {
      refill_failed_ = true;
      if (channels_ == 0 && !fell_back_) fell_back_ = true;
      Log(peer_.rank, absl::StrCat("a step ring dropped after a timeout could not be replaced (",
                                   why, "); ", channels_, " left",
                                   channels_ == 0 ? ", gRPC until the next generation" : ""));
      return;
    }
    --missing_;
    ++refilled_;
    if (fell_back_) return;  // a channel error meanwhile: gRPC for this generation
    ++channels_;
    free_.push_back(std::move(opened.front()));
  }
}

size_t WorkerRings::free_channels() const {
  absl::MutexLock lock(&mu_);
  return free_.size();
}

int WorkerRings::channels() const {
  absl::MutexLock lock(&mu_);
  return fell_back_ ? 0 : channels_;
}

int64_t WorkerRings::refilled() const {
  absl::MutexLock lock(&mu_);
  return refilled_;
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
    // The worker may still answer on it: dropped; the others carry on, and the refill thread
    // opens one in its place.
    if (fell_back_ || refill_failed_ || stopping_) return;
    ++missing_;
    if (!refill_thread_.joinable()) refill_thread_ = std::thread([this] { Refill(); });
    return;
  }
  if (!fell_back_) {
    fell_back_ = true;
    Log(peer_.rank, absl::StrCat("step ring failed (", status.ToString(),
                                 "); gRPC until the next generation"));
  }
  free_.clear();
  channels_ = 0;
}

}  // namespace moe
