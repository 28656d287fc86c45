// MoeClient: a typed C++ client of moed's public API (moe.v1.MoeService, proto/moe.proto)
// plus the standard gRPC health check.
//
// Every method is blocking, returns absl::Status / absl::StatusOr with the server's gRPC code
// and message preserved (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, ...), and runs under a
// deadline: the client's default (ClientOptions::default_deadline) unless the call's
// CallOptions gives one. Tensors go in and out as host moe::Tensor (engine/tensor.h); chunked
// streams (weights, gradients) are split and reassembled here. Thread-safe: one client may be
// used by many threads at once (gRPC channels and stubs are).
//
//   ASSIGN_OR_RETURN(auto client, moe::client::MoeClient::Connect("localhost:50051"));
//   moe::v1::LayerConfig config;
//   config.set_hidden(1024); config.set_ffn(4096); config.set_num_experts(8); config.set_top_k(2);
//   RETURN_IF_ERROR(client->CreateLayer("l0", config).status());
//   ASSIGN_OR_RETURN(auto fwd, client->Forward("l0", x, /*keep_for_backward=*/true));
//   ASSIGN_OR_RETURN(moe::Tensor d_x, client->Backward("l0", fwd.step_id, d_out));
#ifndef MOED_CLIENT_MOE_CLIENT_H_
#define MOED_CLIENT_MOE_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/kept_threads.h"
#include "client/step_channel.h"
#include "engine/tensor.h"
#include "proto/chunking.h"
#include "proto/moe.grpc.pb.h"

namespace grpc {
class Channel;
class Status;
}  // namespace grpc

namespace moe {
class PhaseClock;   // base/phase_clock.h
class TensorBytes;  // proto/tensor_wire.h
namespace client {

// ClientOptions::lanes = 0: this host's cores, at most 16; 1 on a host of 2 cores or fewer.
// Measured on the 16-core H200 host (moed + one CUDA worker, bf16): 16 lanes beat 12 and 8 by
// up to 16 % at 16384 tokens and 9 % for mixtral's 4096, and tied at 4096 tokens of H 1024;
// on the 2-core VM lanes did not help.
int DefaultLanes(int cores);

struct ClientOptions {
  // Deadline of every call that does not set its own.
  absl::Duration default_deadline = absl::Seconds(60);
  // Largest message the client sends (bytes); keep it at or below moed's
  // --max_message_bytes (both default to 256 MiB). Forward / Backward whose tensor (plus
  // 64 KiB for the other fields) does not fit go through ForwardStream / BackwardStream in
  // pieces of this size, so tensors of any size work. Answers of any size are accepted.
  int max_message_bytes = 256 << 20;
  // Chunk size for SetWeights and the size asked for in GetWeights / GetGradients.
  int64_t chunk_bytes = kDefaultChunkBytes;
  // Bearer token sent with every call ("authorization: Bearer <token>"; moed --tokens_file).
  // Empty: none.
  std::string token;
  // TLS: set tls_ca_file (PEM roots that signed moed's certificate) to connect over TLS;
  // tls_cert_file + tls_key_file add a client certificate (moed --tls_client_ca_file).
  // tls_server_name overrides the name checked against the certificate (e.g. "localhost"
  // when dialling 127.0.0.1). All empty: plaintext.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  // Forward / Backward whose tensor has lane_min_bytes or more send it, and fetch the answer,
  // in row ranges over several connections at once (proto/moe.proto, "Staged tensors"): one
  // connection moves ~1.7 GB/s, four ~5 GB/s on a 16-core host. A server that refuses staged
  // tensors (UNIMPLEMENTED: --shm_relay=false; RESOURCE_EXHAUSTED: full), or a lane that
  // cannot connect (UNAVAILABLE), gets the tensor in the step instead. lanes == 1: one
  // connection; 0: DefaultLanes() (docs/PERFORMANCE.md has the measurements).
  int lanes = 0;
  int64_t lane_min_bytes = int64_t{4} << 20;
  // Forward / Backward / ReleaseStep (and their shared-memory forms) go through a step
  // channel (client/step_channel.h: a shared-memory ring, no gRPC call per step) when the
  // target names this host (loopback, unix:) and moed allows it (--allow_client_shm); moed
  // refusing it, or the channel failing, sends the steps over gRPC from then on (one line on
  // stderr). A step whose request or answer may not fit half a ring goes over gRPC.
  // false: always gRPC. step_channel_bytes: each ring's bytes (a power of two). A step whose
  // tensor travels in the request (not in shared memory) uses the channel only up to
  // step_channel_max_inline_bytes: measured on the 2-core build machine, larger inline
  // tensors were slower through the ring than over gRPC (docs/DECISIONS.md).
  bool step_channel = true;
  uint64_t step_channel_bytes = uint64_t{8} << 20;
  size_t step_channel_max_inline_bytes = size_t{64} << 10;
  // The step channel's wait for moed's answer spins up to this long before it sleeps on the
  // futex (transport/doorbell.h, adaptive; a core busy while it spins). Zero: no spin
  // (docs/DECISIONS.md "ring doorbell spin"); moed's side is its --ring_spin_us.
  absl::Duration step_channel_spin = absl::ZeroDuration();
};

// A step's per-phase times (CallOptions::timing): the client's own phases around the server's
// StepTiming (proto/moe.proto says what each server phase covers).
struct StepTimes {
  // Over lanes (ClientOptions::lanes): encode_ms is the StageTensor calls, call_ms the step's
  // own call, decode_ms the FetchStaged calls (each with its copy into the result).
  double encode_ms = 0.0;  // host tensor -> request message
  double call_ms = 0.0;    // the RPC: serialise, wire, moed (server.moed_ms), reply, parse
  double decode_ms = 0.0;  // response message -> host tensor
  v1::StepTiming server;
};

struct CallOptions {
  // Overrides ClientOptions::default_deadline when set.
  std::optional<absl::Duration> deadline;
  // Wait for the channel to become ready (up to the deadline) instead of failing fast with
  // UNAVAILABLE when the server is not up yet.
  bool wait_for_ready = false;
  // Forward / Backward: when set, the server is asked for its StepTiming and this receives
  // it with the client's phases.
  StepTimes* timing = nullptr;
  // Forward / Backward: when set, the answer's tensor (out / d_x) is written into *output
  // instead of a newly allocated tensor, and the returned out / d_x is a view of *output's
  // bytes. A caller that reuses one buffer step after step saves the allocation and its page
  // faults on first touch (measured: a 32 MiB answer copied 2-3x faster into a reused buffer).
  // *output must have the input's datatype and shape (x's, d_out's), else INVALID_ARGUMENT
  // before anything is sent; an answer of another datatype (a Backward with d_out in another
  // datatype than the forward's x) is INVALID_ARGUMENT after the step. Its contents are
  // unspecified when the call fails. Not for the shm calls.
  Tensor* output = nullptr;
  // Forward: ForwardRequest.unbatched (a step of its own, never merged with other callers').
  bool unbatched = false;
};

struct ForwardOutput {
  Tensor out;  // [T, H] in x's dtype
  double aux_loss = 0.0;
  double z_loss = 0.0;
  std::vector<int64_t> tokens_per_expert;  // [E]
  uint64_t step_id = 0;                    // 0 unless keep_for_backward
  v1::ExpertLoad load;
};

// A tensor in a registered shared-memory region (moe.v1.SharedMemoryTensor; the byte size
// follows from dtype and shape).
struct ShmTensorRef {
  std::string region;
  int64_t offset = 0;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
};
// Where the server writes an output (moe.v1.SharedMemoryOutput).
struct ShmOutputRef {
  std::string region;
  int64_t offset = 0;
  int64_t byte_size = 0;  // at least the output's size
};

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
const char* ServingStatusName(ServingStatus status);  // "SERVING", ...

class MoeClient {
 public:
  // Creates the channel (insecure; TLS is not supported yet). Does not contact the server:
  // the first call does (use Health or CallOptions::wait_for_ready to wait for it).
  static absl::StatusOr<std::unique_ptr<MoeClient>> Connect(const std::string& target,
                                                            ClientOptions options = {});

  const std::string& target() const { return target_; }

  // ---- layers ----
  absl::StatusOr<v1::LayerInfo> CreateLayer(const std::string& name, const v1::LayerConfig& config,
                                            const CallOptions& call = {});
  absl::Status DeleteLayer(const std::string& name, const CallOptions& call = {});
  absl::StatusOr<std::vector<v1::LayerInfo>> ListLayers(const CallOptions& call = {});
  absl::StatusOr<v1::LayerInfo> GetLayer(const std::string& name, const CallOptions& call = {});

  // ---- steps ----
  absl::StatusOr<ForwardOutput> Forward(const std::string& layer, const Tensor& x,
                                        bool keep_for_backward = false,
                                        const CallOptions& call = {});
  // d_aux / d_z_loss: unset = 1.0 on the server.
  absl::StatusOr<Tensor> Backward(const std::string& layer, uint64_t step_id, const Tensor& d_out,
                                  std::optional<double> d_aux = std::nullopt,
                                  std::optional<double> d_z_loss = std::nullopt,
                                  const CallOptions& call = {});
  // True if the step was held and is now released.
  absl::StatusOr<bool> ReleaseStep(const std::string& layer, uint64_t step_id,
                                   const CallOptions& call = {});

  // ---- shared memory (same host; moed --allow_client_shm; client/shared_memory.h) ----
  absl::Status RegisterSystemSharedMemory(const std::string& name, const std::string& key,
                                          int64_t offset, int64_t byte_size,
                                          const CallOptions& call = {});
  // name empty: every region.
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> SystemSharedMemoryStatus(
      const std::string& name = "", const CallOptions& call = {});
  absl::Status UnregisterSystemSharedMemory(const std::string& name, const CallOptions& call = {});
  // A region of this process's GPU memory (CUDA workers on moed's host): raw_handle is the
  // 64 bytes of cudaIpcGetMemHandle for an allocation of at least byte_size bytes on
  // `device_id`. Listed and unregistered by the two calls above; steps name it as any region.
  absl::Status RegisterCudaSharedMemory(const std::string& name, const std::string& raw_handle,
                                        int64_t device_id, int64_t byte_size,
                                        const CallOptions& call = {});
  // Forward / Backward reading x / d_out from a region and writing out / d_x into one:
  // ForwardOutput::out stays empty (its bytes are in the region).
  absl::StatusOr<ForwardOutput> ForwardShm(const std::string& layer, const ShmTensorRef& x,
                                           const ShmOutputRef& out, bool keep_for_backward = false,
                                           const CallOptions& call = {});
  absl::Status BackwardShm(const std::string& layer, uint64_t step_id, const ShmTensorRef& d_out,
                           const ShmOutputRef& d_x, std::optional<double> d_aux = std::nullopt,
                           std::optional<double> d_z_loss = std::nullopt,
                           const CallOptions& call = {});

  // ---- training ----
  // Whole-layer fp32 gradients; names empty = every parameter with a gradient.
  absl::StatusOr<std::vector<NamedTensor>> GetGradients(const std::string& layer,
                                                        const std::vector<std::string>& names = {},
                                                        const CallOptions& call = {});
  absl::Status ZeroGradients(const std::string& layer, const CallOptions& call = {});
  // `response` (optional) receives the layer's optimizer step and, with moed --state_dir,
  // its durable step (ApplyOptimizerResponse).
  // `expected_optimizer_step` (optional; ApplyOptimizerRequest.expected_optimizer_step): the
  // step is applied only if the layer is at that optimizer step and no re-formation or moed
  // restart dropped its gradients since the last ZeroGradients or optimizer step; otherwise
  // ABORTED and nothing changes. A trainer passes the step its gradients were computed on
  // (LayerInfo.optimizer_step, then each answer's optimizer_step), so gradients lost in a
  // re-formation are never applied; after ABORTED: GetLayer, ZeroGradients, run the batch again.
  absl::Status ApplySgd(const std::string& layer, const v1::SgdOptimizer& sgd,
                        const CallOptions& call = {},
                        v1::ApplyOptimizerResponse* response = nullptr,
                        std::optional<int64_t> expected_optimizer_step = std::nullopt);
  absl::Status ApplyAdamW(const std::string& layer, const v1::AdamWOptimizer& adamw,
                          const CallOptions& call = {},
                          v1::ApplyOptimizerResponse* response = nullptr,
                          std::optional<int64_t> expected_optimizer_step = std::nullopt);
  // Returns the expert bias after the update, [E].
  absl::StatusOr<std::vector<float>> UpdateExpertBias(const std::string& layer, double rate,
                                                      const CallOptions& call = {});

  // ---- weights and checkpoints ----
  absl::StatusOr<std::vector<NamedTensor>> GetWeights(const std::string& layer,
                                                      const std::vector<std::string>& names = {},
                                                      const CallOptions& call = {});
  // Sends every tensor in chunks of ClientOptions::chunk_bytes; returns the names the server
  // replaced. The server applies nothing unless the whole stream is valid.
  absl::StatusOr<std::vector<std::string>> SetWeights(const std::string& layer,
                                                      const std::vector<NamedTensor>& tensors,
                                                      const CallOptions& call = {});
  // `directory` names the checkpoint inside the server's --checkpoint_root ("run7/layer0";
  // see SaveCheckpointRequest in proto/moe.proto). Returns the name written.
  absl::StatusOr<std::string> SaveCheckpoint(const std::string& layer, const std::string& directory,
                                             const CallOptions& call = {});
  absl::Status LoadCheckpoint(const std::string& layer, const std::string& directory,
                              const CallOptions& call = {});

  // ---- operations ----
  absl::StatusOr<v1::GetStatusResponse> GetStatus(const CallOptions& call = {});
  // grpc.health.v1.Health/Check for `service` ("" = the whole server).
  absl::StatusOr<ServingStatus> Health(const std::string& service = "",
                                       const CallOptions& call = {});

  v1::MoeService::Stub* stub() { return stub_.get(); }
  // Steps answered through the step channel so far, and whether it is (still) in use.
  uint64_t steps_over_channel() const { return step_channel_ ? step_channel_->steps() : 0; }
  bool step_channel_on() const { return step_channel_ != nullptr && step_channel_->on(); }

 private:
  // How errors about CallOptions::output name it.
  static constexpr char kOutputName[] = "CallOptions::output";

  MoeClient(std::string target, ClientOptions options, std::shared_ptr<grpc::Channel> channel,
            std::vector<std::shared_ptr<grpc::Channel>> lanes);
  // Forward / Backward: whether `tensor` goes through the streaming call, in pieces of
  // PieceBytes().
  bool NeedsStream(const Tensor& tensor) const;
  size_t PieceBytes() const;
  // Applies the deadline and wait-for-ready of `call` to a fresh context.
  void Prepare(const CallOptions& call, grpc::ClientContext* context) const;
  // A unary Forward or Backward (`kind`) sent around `tensor`'s bytes (not copied) as the
  // request's tensor field (x, d_out) of `head` (proto/tensor_wire.h); the answer split into
  // *answer and the bytes of its tensor field (out, d_x), not copied yet. *encode_ms: the time
  // to encode, from `clock`'s last lap.
  absl::Status CallStep(StepKind kind, const google::protobuf::MessageLite& head,
                        const Tensor& tensor, const CallOptions& call, PhaseClock* clock,
                        double* encode_ms, google::protobuf::MessageLite* answer,
                        TensorBytes* answer_bytes);
  // Everything of a ForwardResponse but `out` (the gRPC and shared-memory paths share it).
  static void TakeForwardResults(v1::ForwardResponse* response, ForwardOutput* output);
  // A whole-message step (ForwardShm, BackwardShm, ReleaseStep) on the step channel: its
  // status, *response parsed; nullopt when it is to go over gRPC.
  std::optional<absl::Status> MessageOnChannel(StepKind kind,
                                               const google::protobuf::MessageLite& request,
                                               const CallOptions& call,
                                               google::protobuf::MessageLite* response);

  // ---- over several connections (moe_client_lanes.cc) ----
  // Whether `tensor` goes over the lanes.
  bool UsesLanes(const Tensor& tensor) const;
  // A fresh staged-tensor name.
  std::string NextStagedName();
  // StageTensor of `tensor`'s rows, one range per lane, concurrently. A refusal that means
  // "send it in the step" (UNIMPLEMENTED, RESOURCE_EXHAUSTED) comes back as is; after
  // UNIMPLEMENTED the lanes stay off.
  absl::Status StageRows(const std::string& name, const Tensor& tensor, const CallOptions& call);
  // FetchStaged of the whole output `head` (datatype, shape) in row ranges, concurrently,
  // each copied once into the returned tensor.
  absl::StatusOr<Tensor> FetchRows(const std::string& name, const v1::Tensor& head,
                                   const CallOptions& call);
  // The staged step both use: stages `tensor`, has name(&request, in, out) name it and the
  // output to keep, calls rpc(context, request, response) and fetches (response->*answer)();
  // StepTimes as in ClientOptions::lanes. *sent: false when the server asked for the tensor in
  // the step instead.
  template <typename Request, typename Response, typename Name, typename Rpc>
  absl::StatusOr<Tensor> StepOverLanes(Request request, const Tensor& tensor,
                                       const CallOptions& call, bool* sent, Name name, Rpc rpc,
                                       const v1::Tensor& (Response::*answer)() const,
                                       Response* response);
  // Forward / Backward of a staged input, the output staged too and fetched.
  absl::StatusOr<ForwardOutput> ForwardOverLanes(v1::ForwardRequest request, const Tensor& x,
                                                 const CallOptions& call, bool* sent);
  absl::StatusOr<Tensor> BackwardOverLanes(v1::BackwardRequest request, const Tensor& d_out,
                                           const CallOptions& call, bool* sent);
  absl::StatusOr<std::vector<NamedTensor>> ReadChunks(
      grpc::ClientReaderInterface<v1::TensorChunk>* reader, grpc::ClientContext* context);
  // GetWeights / GetGradients: a Request for `layer` and `names`, the stream open(context,
  // request) returns, read whole.
  template <typename Request, typename Open>
  absl::StatusOr<std::vector<NamedTensor>> ReadTensors(const std::string& layer,
                                                       const std::vector<std::string>& names,
                                                       const CallOptions& call, Open open);
  // ApplySgd / ApplyAdamW.
  absl::Status ApplyOptimizer(const v1::ApplyOptimizerRequest& request, const CallOptions& call,
                              v1::ApplyOptimizerResponse* answer);

  const std::string target_;
  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::MoeService::Stub> stub_;
  // One connection each (ClientOptions::lanes; empty when lanes <= 1).
  std::vector<std::shared_ptr<grpc::Channel>> lanes_;
  std::atomic<bool> lanes_refused_{false};  // the server answered UNIMPLEMENTED
  KeptThreads lane_threads_;                // run the lanes' calls; kept between steps
  const std::string staged_prefix_;         // random per client
  std::atomic<uint64_t> next_staged_{0};
  std::unique_ptr<ClientStepChannel> step_channel_;  // null: steps over gRPC only
};

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_MOE_CLIENT_H_
