// MoeLayer: one Mixture-of-Experts layer of docs/SPEC.md on one rank of an expert-parallel group.
//
// Rank r of R owns experts [r*El, (r+1)*El) (El = E / R) and their rows of every expert
// tensor; the router (gate, expert_bias) is replicated. Forward and Backward are collective:
// every rank calls them in the same order, each with its own tokens (T may be 0 on a rank).
// The layer owns fp32 master parameters, their gradients (accumulated until zeroed), the
// optimizer state and the compute-dtype copies of the expert weights, all in the backend's
// memory. Not thread-safe: the caller serialises calls on one layer.
//
//   ASSIGN_OR_RETURN(auto layer, MoeLayer::Create(config, backend.get(), comm.get()));
//   std::unique_ptr<StepContext> saved;
//   ASSIGN_OR_RETURN(ForwardResult fwd, layer->Forward(x, &saved));
//   ASSIGN_OR_RETURN(Tensor d_x, layer->Backward(*saved, d_out, /*d_aux=*/1.0, /*d_z_loss=*/1.0));
//   RETURN_IF_ERROR(layer->ApplyOptimizer(OptimizerConfig::Sgd(0.1)));
#ifndef MOED_ENGINE_MOE_LAYER_H_
#define MOED_ENGINE_MOE_LAYER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/comm/communicator.h"
#include "engine/config.h"
#include "engine/tensor.h"

namespace moe {

struct OptimizerConfig {
  enum class Kind { kSgd, kAdamW };
  Kind kind = Kind::kSgd;
  double lr = 1e-3;
  double momentum = 0.0;       // SGD
  double beta1 = 0.9;          // AdamW
  double beta2 = 0.999;        // AdamW
  double eps = 1e-8;           // AdamW
  double weight_decay = 0.0;
  // Multiplies the accumulated gradient before the step (weight decay is not scaled): the
  // front end's data-parallel steps pass 1/num_ranks, so N ranks' summed gradients become
  // their mean. > 0; 1 = the gradient as accumulated.
  double grad_scale = 1.0;
  static OptimizerConfig Sgd(double lr, double momentum = 0.0, double weight_decay = 0.0);
  static OptimizerConfig AdamW(double lr, double weight_decay = 0.0);
};

struct ForwardResult {
  Tensor out;                               // [T, H] in x's dtype
  double aux_loss = 0.0;                    // global (the same on every rank)
  double z_loss = 0.0;                      // global
  std::vector<int64_t> tokens_per_expert;   // [E] global (token, slot) pairs, before drops
  // [T, k] this rank's selected experts per token in slot order (before drops), only when
  // Forward was asked for them: a caller that merged several requests into one step counts
  // each request's own tokens_per_expert from its rows (server/forward_batcher.h).
  std::vector<int32_t> routed_experts;
};

// What a forward keeps for its backward (saved activations, routing plan). Opaque.
class StepContext {
 public:
  virtual ~StepContext() = default;
  virtual size_t bytes() const = 0;  // backend memory held
};

// How a process runs its layers, beside their config (which is the same on every rank and in
// checkpoints): set by the worker's flags (server/engine_flags.h).
struct MoeLayerOptions {
  // The deferral budget of the expert weight gradients (docs/SPEC.md "Weight gradients of
  // several backwards") as a fraction of a rank's wi and wo gradient bytes; >= 0, 0 turns
  // deferral off (DeferredWgradBudgetBytes, CheckDeferredWgradFraction in engine/config.h).
  double deferred_wgrad_fraction = kDefaultDeferredWgradFraction;
};

class MoeLayer {
 public:
  // Validates `config` for comm->size() ranks and initialises the parameters from
  // config.init_seed (docs/SPEC.md "Initialisation"); gradients start at zero. backend and comm
  // must outlive the layer; comm->memory_space() must equal backend->memory_space().
  // `cancelled` (optional) is polled between groups of experts of about 4 MiB each while the
  // parameters are initialised (no collective runs there): when it returns true, Create frees
  // what it allocated and returns CANCELLED. `options` out of range: INVALID_ARGUMENT.
  static absl::StatusOr<std::unique_ptr<MoeLayer>> Create(
      const LayerConfig& config, Backend* backend, Communicator* comm,
      const std::function<bool()>& cancelled = nullptr, const MoeLayerOptions& options = {});
  virtual ~MoeLayer() = default;

  virtual const LayerConfig& config() const = 0;
  virtual int64_t first_expert() const = 0;   // r * El
  virtual int64_t local_experts() const = 0;  // El
  // The expert GEMMs that run on FP8 operands (engine/fp8_gemms.h): config().fp8_gemms
  // resolved on this backend at creation (AUTO: Backend::Fp8GemmPays per GEMM); empty unless
  // compute_dtype is FP8. The same on every rank of a backend kind.
  virtual Fp8GemmSet fp8_gemms() const = 0;

  // x: [T, H], FP32 or BF16. With `saved` non-null, keeps what Backward needs there.
  absl::StatusOr<ForwardResult> Forward(const Tensor& x, std::unique_ptr<StepContext>* saved) {
    return Forward(x, saved, nullptr);
  }
  // The same, writing the output into `out` when it is non-null: a tensor of x's dtype and
  // shape, typically a Tensor::View of a caller's buffer (shared memory, pinned staging), so
  // the output skips a host copy. result.out is then a copy of *out (a view if out is one).
  absl::StatusOr<ForwardResult> Forward(const Tensor& x, std::unique_ptr<StepContext>* saved,
                                        Tensor* out) {
    return Forward(x, saved, out, /*routed_experts=*/false);
  }
  // The same; with `routed_experts`, result.routed_experts holds every token's selected
  // experts (one more device-to-host copy of T * k int32).
  virtual absl::StatusOr<ForwardResult> Forward(const Tensor& x,
                                                std::unique_ptr<StepContext>* saved, Tensor* out,
                                                bool routed_experts) = 0;
  // d_out: [T, H] (FP32 or BF16). Accumulates every parameter gradient; returns d_x in x's
  // dtype. A context may be used for one backward only (FAILED_PRECONDITION afterwards).
  absl::StatusOr<Tensor> Backward(StepContext& saved, const Tensor& d_out, double d_aux,
                                  double d_z_loss) {
    return Backward(saved, d_out, d_aux, d_z_loss, nullptr);
  }
  // The same, writing d_x into `d_x` when it is non-null (x's dtype and shape), as in Forward.
  virtual absl::StatusOr<Tensor> Backward(StepContext& saved, const Tensor& d_out, double d_aux,
                                          double d_z_loss, Tensor* d_x) = 0;

  // Parameters, this rank's shard as host fp32 tensors:
  //   "gate" [H, E], "expert_bias" [E] (use_expert_bias), "wi" [El, H, up], "wo" [El, F, H],
  //   "wi_bias" [El, up], "wo_bias" [El, H] (use_bias); up = 2F gated (wi_0 | wi_1) else F.
  virtual std::vector<std::string> ParameterNames() const = 0;
  virtual absl::StatusOr<Tensor> GetParameter(const std::string& name) const = 0;
  // Replaces a master tensor (shape checked) and refreshes its compute copy.
  virtual absl::Status SetParameter(const std::string& name, const Tensor& value) = 0;
  // Gradient of a parameter (same names and shapes; "expert_bias" has none). "gate" holds the
  // all-reduced gradient, identical on every rank. Runs the deferred weight-gradient GEMMs
  // first when `name` is "wi" or "wo" (FlushGradients).
  virtual absl::StatusOr<Tensor> GetGradient(const std::string& name) = 0;
  // Zeroes every gradient (and drops the deferred weight-gradient operands).
  virtual absl::Status ZeroGradients() = 0;
  // Backward may defer the expert weight gradients' GEMMs (docs/SPEC.md "Weight gradients of
  // several backwards"): this runs every deferred one now, so that wi and wo's gradients hold
  // every backward since the last zeroing. GetGradient and ApplyOptimizer call it themselves;
  // callers need it only to time a step's whole work or to free the operands' memory.
  virtual absl::Status FlushGradients() = 0;

  // One optimizer step on every parameter from the accumulated gradients, then refreshes the
  // compute copies and zeroes the gradients. Not collective (the gate gradient is already
  // reduced, so every rank takes the same router step).
  virtual absl::Status ApplyOptimizer(const OptimizerConfig& optimizer) = 0;
  // The name of the first parameter (ParameterNames() order) whose accumulated gradient holds
  // a NaN or an Inf, or "" when every gradient is finite; runs the deferred weight-gradient
  // GEMMs first (FlushGradients). ApplyOptimizer does not check: a caller that must not step
  // on such gradients asks first (moed asks every worker before any steps, so that all or
  // none of the shards step; docs/SPEC.md "Updates").
  virtual absl::StatusOr<std::string> NonFiniteGradient() = 0;
  // Optimizer state by parameter: "<param>.m", "<param>.v" (AdamW) or "<param>.m" (SGD
  // momentum), plus "step" ([1] fp32 holding the AdamW step count); empty before the first
  // step. Under FP8 with delayed scaling also this rank's amax histories, "fp8.amax_history"
  // [4, len] and "fp8.amax_steps" [4] (engine/fp8_history.h; emptied by SetParameter). For
  // checkpoints.
  virtual std::vector<std::string> StateNames() const = 0;
  virtual absl::StatusOr<Tensor> GetState(const std::string& name) const = 0;
  virtual absl::Status SetState(const std::string& name, const Tensor& value) = 0;
  // Drops every optimizer state (as on a new layer: the next step starts momentum and AdamW's
  // moments and step count from zero) and frees its memory. The FP8 histories stay.
  virtual absl::Status ResetOptimizerState() = 0;

  // Aux-loss-free balancing (docs/SPEC.md Updates): b_e += rate * sign(mean(f) - f_e) over the
  // global counts accumulated by forwards since the last update; then the counts restart at zero.
  virtual absl::Status UpdateExpertBias(double rate) = 0;
  // Global (token, slot) pairs per expert accumulated since the last UpdateExpertBias.
  virtual std::vector<int64_t> accumulated_expert_counts() const = 0;

  virtual Backend* backend() const = 0;
  virtual Communicator* communicator() const = 0;
};

}  // namespace moe

#endif  // MOED_ENGINE_MOE_LAYER_H_
