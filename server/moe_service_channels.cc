// MoeServiceImpl: step channels (proto/moe.proto "Step channels"; transport/README.md
// "Phase 2"). OpenStepChannel is gated as client shared memory (CheckShmAllowed) and captures
// the caller's identity; StepChannels (server/step_channels.h) serves each channel on its own
// thread, and every record is answered by AnswerStepRecord (moe_service_rpcs.cc) with the same
// DoForward / DoBackward / DoReleaseStep a gRPC call runs.
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "server/moe_service.h"

namespace moe {

absl::Status MoeServiceImpl::AllowChannel(const ChannelIdentity& who, Role role) const {
  if (options_.auth == nullptr) return absl::OkStatus();
  absl::Status allowed = options_.auth->AuthorizeHash(who.token_hash, role);
  if (!allowed.ok() && metrics_ != nullptr) {
    metrics_->CountDenied(std::string(RoleName(role)), static_cast<int>(allowed.code()));
  }
  return allowed;
}

grpc::Status MoeServiceImpl::DoOpenStepChannel(grpc::ServerContextBase* context,
                                               const v1::OpenStepChannelRequest* request,
                                               v1::OpenStepChannelResponse* response) {
  const absl::Time start = absl::Now();
  auto run = [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckShmAllowed(context));
    ChannelIdentity who;
    who.client = ClientOf(*context);
    who.peer = context->peer();
    if (options_.auth != nullptr) {
      ASSIGN_OR_RETURN(who.token_hash, TokenAuthenticator::TokenHash(*context));
      absl::MutexLock lock(&channel_tokens_mu_);
      channel_tokens_[who.client] = who.token_hash;
    }
    StepChannels::Handler handler = [this, who](absl::string_view record,
                                                const StepChannels::Cancelled& cancelled) {
      return AnswerStepRecord(who, record, cancelled);
    };
    ASSIGN_OR_RETURN(StepChannels::Opened opened,
                     step_channels_->Open(who.client, request->ring_bytes(), request->caller_pid(),
                                          absl::FromChrono(context->deadline()),
                                          std::move(handler)));
    response->set_name(opened.name);
    response->set_channel_id(opened.id);
    response->set_ring_bytes(opened.ring_bytes);
    return absl::OkStatus();
  };
  return Finish("OpenStepChannel", start, run());
}

grpc::Status MoeServiceImpl::DoCloseStepChannel(grpc::ServerContextBase* context,
                                                const v1::CloseStepChannelRequest* request,
                                                v1::CloseStepChannelResponse*) {
  const absl::Time start = absl::Now();
  absl::Status status = CheckShmAllowed(context);
  if (status.ok()) status = step_channels_->Close(ClientOf(*context), request->channel_id());
  return Finish("CloseStepChannel", start, status);
}

int MoeServiceImpl::CloseRevokedStepChannels() {
  if (step_channels_ == nullptr || options_.auth == nullptr) return 0;
  // A channel's records are refused once its token went away (AllowChannel); this frees its
  // thread and region now. Owners are ClientOf's names, each of one token.
  std::map<std::string, std::string> tokens;
  {
    absl::MutexLock lock(&channel_tokens_mu_);
    tokens = channel_tokens_;
  }
  const int closed = step_channels_->CloseIf([&](const std::string& owner) {
    auto it = tokens.find(owner);
    return it == tokens.end() || !options_.auth->AuthorizeHash(it->second, Role::kInfer).ok();
  });
  if (closed > 0) {
    std::fprintf(stderr, "moed: closed %d step channel(s) whose token went away\n", closed);
  }
  return closed;
}

}  // namespace moe
