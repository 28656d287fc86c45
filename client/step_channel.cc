#include "client/step_channel.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "transport/shm_object.h"
#include "transport/step_envelope.h"

namespace moe {
namespace client {

bool IsLocalTarget(absl::string_view target) {
  if (absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:")) return true;
  for (absl::string_view prefix : {"dns:///", "ipv4:", "ipv6:"}) absl::ConsumePrefix(&target, prefix);
  absl::string_view host = target;
  if (absl::ConsumePrefix(&host, "[")) {
    host = host.substr(0, host.find(']'));
  } else if (std::count(target.begin(), target.end(), ':') == 1) {
    host = target.substr(0, target.find(':'));
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

void ClientStepChannel::TurnOff(const std::string& why) {
  off_.store(true, std::memory_order_release);
  ring_.reset();
  std::fprintf(stderr, "moe client: steps go over gRPC: %s\n", why.c_str());
}

RingChannel* ClientStepChannel::Open() {
  if (ring_ != nullptr) return ring_.get();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!token_.empty()) context.AddMetadata("authorization", "Bearer " + token_);
  v1::OpenStepChannelRequest request;
  request.set_ring_bytes(ring_bytes_);
  request.set_caller_pid(static_cast<uint32_t>(getpid()));
  v1::OpenStepChannelResponse response;
  grpc::Status opened = stub_->OpenStepChannel(&context, request, &response);
  if (!opened.ok()) {
    TurnOff(absl::StrCat("moed refused a step channel (", opened.error_code(), ": ",
                         opened.error_message(), ")"));
    return nullptr;
  }
  absl::StatusOr<ShmObject> object = ShmObject::OpenNamed(response.name());
  RingChannelOptions ring_options;
  ring_options.max_spin = max_spin_;
  absl::StatusOr<std::unique_ptr<RingChannel>> ring =
      object.ok()
          ? RingChannel::Attach(std::move(*object), RingChannel::Role::kCaller, ring_options)
          : absl::StatusOr<std::unique_ptr<RingChannel>>(object.status());
  if (!ring.ok()) {
    TurnOff(absl::StrCat("could not attach the step channel: ", ring.status().ToString()));
    return nullptr;
  }
  ring_ = std::move(*ring);
  return ring_.get();
}

std::optional<absl::StatusOr<std::string>> ClientStepChannel::Call(StepKind kind,
                                                                   absl::string_view body,
                                                                   size_t answer_bytes,
                                                                   absl::Duration timeout) {
  if (!Fits(body.size(), answer_bytes)) return std::nullopt;
  if (!busy_.TryLock()) return std::nullopt;
  absl::Cleanup unlock = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { busy_.Unlock(); };
  RingChannel* ring = Open();
  if (ring == nullptr) return std::nullopt;
  bool answered = false;
  // One second past the step's own deadline: moed's DEADLINE_EXCEEDED comes first.
  absl::StatusOr<std::string> answer =
      ring->Call(EncodeStepEnvelope(static_cast<uint8_t>(kind), timeout, body),
                 absl::Now() + timeout + absl::Seconds(1), &answered);
  if (!answered && (absl::IsUnavailable(answer.status()) || absl::IsDataLoss(answer.status()))) {
    TurnOff(absl::StrCat("the step channel failed: ", answer.status().ToString()));
    return std::nullopt;
  }
  if (answered && answer.ok()) steps_.fetch_add(1, std::memory_order_relaxed);
  return answer;
}

}  // namespace client
}  // namespace moe
