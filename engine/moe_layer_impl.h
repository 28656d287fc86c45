// The MoeLayer implementation class (private to the engine): parameter storage shared by
// moe_layer.cc (Create, Forward, Backward) and moe_layer_params.cc (accessors, optimizer).
//
//   auto layer = std::make_unique<MoeLayerImpl>(config, backend, comm);
//   RETURN_IF_ERROR(layer->Init(/*cancelled=*/nullptr));
#ifndef MOED_ENGINE_MOE_LAYER_IMPL_H_
#define MOED_ENGINE_MOE_LAYER_IMPL_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/dispatch.h"
#include "engine/moe_layer.h"

namespace moe {

// One parameter: fp32 master, fp32 gradient (accumulated), optional compute-dtype copy and
// optimizer state, all backend memory.
//
// Zero gradients are lazy: after creation, ZeroGradients and ApplyOptimizer the gradient is
// zero by definition (grad_zero) and `grad`'s bytes are stale. The next backward then writes
// the gradient (GEMM beta = 0: no memset, and C is not read) instead of adding to zeros, which
// gives the same values (0 + x == x) for half the memory traffic; readers that need the bytes
// (GetGradient, the optimizer, the bias-gradient sums) see zeros.
struct LayerParam {
  std::string name;
  std::vector<int64_t> shape;  // this rank's shard
  bool has_grad = true;        // expert_bias has none
  bool grad_zero = true;       // the gradient is all zero; `grad` holds stale bytes
  bool has_compute_copy = false;  // wi, wo under compute_dtype = BF16
  Buffer master, grad, compute;
  Buffer m, v;                 // optimizer state (empty until needed)
  int64_t count() const { return NumElements(shape); }
};

// What Forward keeps for Backward. Buffers are backend memory; layouts as in dispatch.h.
struct SavedStep : public StepContext {
  const void* layer = nullptr;
  bool used = false;
  int64_t tokens = 0;           // T on this rank
  double global_tokens = 0;     // T_g
  DType x_type = DType::kFloat32;
  std::vector<int64_t> global_counts;  // f [E]
  DispatchPlan plan;
  Buffer x32;          // [T, H] fp32 input (router backward, d_gate)
  Buffer logits;       // [T, E]
  Buffer scores;       // [T, E]
  Buffer logsumexp;    // [T]
  Buffer topk_expert;  // [T, k] int32
  Buffer topk_weight;  // [T, k] fp32 probs
  Buffer pair_row;     // [T, k] int32 row in the local layout, -1 dropped
  Buffer x_expert;     // [expert_rows, H] compute dtype, expert layout
  Buffer h;            // [expert_rows, up] compute dtype, after the up bias
  Buffer act;          // [expert_rows, F] compute dtype
  Buffer y_local;      // [local_rows, H] compute dtype, local layout
  size_t bytes() const override {
    return x32.size() + logits.size() + scores.size() + logsumexp.size() + topk_expert.size() +
           topk_weight.size() + pair_row.size() + x_expert.size() + h.size() + act.size() +
           y_local.size();
  }
};

class MoeLayerImpl : public MoeLayer {
 public:
  MoeLayerImpl(const LayerConfig& config, Backend* backend, Communicator* comm);
  // Allocates and initialises every parameter; `cancelled` as in MoeLayer::Create.
  absl::Status Init(const std::function<bool()>& cancelled);

  const LayerConfig& config() const override { return config_; }
  int64_t first_expert() const override { return first_expert_; }
  int64_t local_experts() const override { return local_experts_; }

  absl::StatusOr<ForwardResult> Forward(const Tensor& x,
                                        std::unique_ptr<StepContext>* saved) override;
  absl::StatusOr<Tensor> Backward(StepContext& saved, const Tensor& d_out, double d_aux,
                                  double d_z_loss) override;

  std::vector<std::string> ParameterNames() const override;
  absl::StatusOr<Tensor> GetParameter(const std::string& name) const override;
  absl::Status SetParameter(const std::string& name, const Tensor& value) override;
  absl::StatusOr<Tensor> GetGradient(const std::string& name) const override;
  absl::Status ZeroGradients() override;
  absl::Status ApplyOptimizer(const OptimizerConfig& optimizer) override;
  std::vector<std::string> StateNames() const override;
  absl::StatusOr<Tensor> GetState(const std::string& name) const override;
  absl::Status SetState(const std::string& name, const Tensor& value) override;
  absl::Status UpdateExpertBias(double rate) override;
  std::vector<int64_t> accumulated_expert_counts() const override { return accumulated_counts_; }
  Backend* backend() const override { return backend_; }
  Communicator* communicator() const override { return comm_; }

 private:
  LayerParam* Find(const std::string& name);
  const LayerParam* Find(const std::string& name) const;
  // The weights the GEMMs read: the compute copy when there is one, else the master.
  const void* ComputeWeights(const LayerParam& p) const {
    return p.has_compute_copy ? p.compute.data() : p.master.data();
  }
  absl::Status RefreshComputeCopy(LayerParam& p);
  // Writes the zeros of a lazily zeroed gradient (grad_zero) into its buffer.
  absl::Status MaterializeGradient(LayerParam& p);
  absl::StatusOr<Buffer> Upload(const void* host, size_t bytes);
  absl::StatusOr<Tensor> Download(const Buffer& buffer, DType dtype,
                                  const std::vector<int64_t>& shape) const;
  // The FFN of the local experts on the expert layout (docs/SPEC.md Forward 10).
  absl::Status ExpertsForward(const DispatchPlan& plan, const void* x_expert, void* h, void* act,
                              void* y);
  // docs/SPEC.md Backward 3: accumulates the expert gradients and writes d_x_expert.
  absl::Status ExpertsBackward(const SavedStep& s, const void* d_y, void* d_x_expert);

  const LayerConfig config_;
  Backend* const backend_;
  Communicator* const comm_;
  const int rank_, ranks_;
  const int64_t local_experts_, first_expert_;
  std::vector<LayerParam> params_;  // gate, [expert_bias], wi, wo, [wi_bias, wo_bias]
  int64_t optimizer_step_ = 0;      // AdamW step count; 0 = no state yet
  std::vector<int64_t> accumulated_counts_;  // [E] global counts since UpdateExpertBias
};

}  // namespace moe

#endif  // MOED_ENGINE_MOE_LAYER_IMPL_H_
