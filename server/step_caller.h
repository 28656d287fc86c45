// StepCaller: who asks for a step, as DoForward / DoBackward / DoReleaseStep need to know it
// (transport/README.md "Phase 2", item 3). The step code uses exactly four things of its
// caller: the peer (shared memory only for callers on this host), the client (the staging
// and shared-memory books' owner, HandlerPool's per-client key), the deadline (the layer's
// turn, non-collective worker calls) and whether the caller left (a started step's answer is
// dropped, a kept step released). A gRPC call (GrpcStepCaller) and a step channel's record
// (server/step_channel_service.cc) both make one, so the same code runs on the same bytes.
#ifndef MOED_SERVER_STEP_CALLER_H_
#define MOED_SERVER_STEP_CALLER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/time/time.h"

namespace moe {

// The kind byte of a step channel record's envelope (transport/step_envelope.h).
enum class StepRecordKind : uint8_t { kForward = 1, kBackward = 2, kReleaseStep = 3 };

class StepCaller {
 public:
  virtual ~StepCaller() = default;
  // The caller's address as gRPC spells it ("ipv4:127.0.0.1:5432"): IsLocalPeer decides.
  virtual std::string peer() const = 0;
  // MoeServiceImpl::ClientOf of the caller: "token <sha256>" with tokens, else its host.
  virtual const std::string& client() const = 0;
  // The caller's deadline (InfiniteFuture: none).
  virtual absl::Time deadline() const = 0;
  // True once the caller left (cancelled the call, closed its channel or exited).
  virtual bool cancelled() const = 0;
};

// A gRPC call's caller; `context` outlives it.
class GrpcStepCaller final : public StepCaller {
 public:
  GrpcStepCaller(grpc::ServerContextBase* context, std::string client)
      : context_(context), client_(std::move(client)) {}
  std::string peer() const override { return context_->peer(); }
  const std::string& client() const override { return client_; }
  absl::Time deadline() const override { return absl::FromChrono(context_->deadline()); }
  bool cancelled() const override { return context_->IsCancelled(); }

 private:
  grpc::ServerContextBase* const context_;
  const std::string client_;
};

}  // namespace moe

#endif  // MOED_SERVER_STEP_CALLER_H_
