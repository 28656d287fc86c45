// The MoeLayer implementation class (private to the engine). Its methods live in
// moe_layer_forward.cc (Forward and its stages), moe_layer_backward.cc (Backward and its
// stages), moe_layer_experts.cc (the expert FFN both ways) and moe_layer_params.cc (Create,
// accessors, optimizer). Forward and Backward are short lists of stage calls, one per group
// of docs/SPEC.md steps; each stage's comment below says which SavedStep fields and which
// ForwardWork / BackwardWork fields it reads and writes.
//
//   auto layer = std::make_unique<MoeLayerImpl>(config, backend, comm);
//   RETURN_IF_ERROR(layer->Init(/*cancelled=*/nullptr, MoeLayerOptions{}));
#ifndef MOED_ENGINE_MOE_LAYER_IMPL_H_
#define MOED_ENGINE_MOE_LAYER_IMPL_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/dispatch.h"
#include "engine/fp8_history.h"
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
  std::vector<int64_t> shape;     // this rank's shard
  bool has_grad = true;           // expert_bias has none
  bool grad_zero = true;          // the gradient is all zero; `grad` holds stale bytes
  bool has_compute_copy = false;  // wi, wo under compute_dtype = BF16 or FP8
  Buffer master, grad, compute;
  // FP8 only (docs/SPEC.md "FP8"): `compute` holds e4m3 codes in the master's layout
  // [El, r, c] (the backward's B operand), compute_t each expert transposed [El, c, r] (the
  // forward's), compute_scale the [El] per-expert dequantisation scales of both.
  Buffer compute_t, compute_scale;
  // FP8 with some data GEMM of this weight in bf16 (MoeLayerImpl::fp8_gemms_): the bf16 copy
  // those GEMMs read, the very bytes the BF16 layer's `compute` holds. `compute` and its
  // scales are then only allocated when another data GEMM of the weight quantises.
  Buffer compute_bf16;
  Buffer m, v;  // optimizer state (empty until needed)
  int64_t count() const { return NumElements(shape); }
};

// The FP8 copy of one expert-layout GEMM input [rows, cols] (docs/SPEC.md "FP8"), quantised
// once: the per-tensor scale (16-byte aligned, as cuBLASLt wants it), the codes as stored (the
// activation GEMMs' A operand) and grouped transposed (QuantizeArgs::dst_grouped_t, [cols,
// Fp8GroupedColumns(group_rows)]: the weight-gradient GEMMs' operands). All empty unless
// compute_dtype = FP8; `rows` is freed as soon as its GEMM is enqueued.
struct Fp8Rows {
  DType fp8 = DType::kFloat8E4M3;
  // float [kFp8ScaleStride]: [0] the scale, [1] the producer's amax slot under current scaling
  // (see amax()), [2] the delayed amax from the history (from_history).
  Buffer scale;
  Buffer rows;     // [rows, cols] codes
  Buffer columns;  // [cols, Fp8GroupedColumns(group_rows)] codes, zero pads
  // Set by PrepareFp8: the tensor's producer reduces its amax into amax() (e.g.
  // ActivationArgs::amax), and QuantizeExpertRows skips its own amax pass.
  bool amax_from_producer = false;
  // Delayed scaling (PrepareFp8, Fp8History::Slot): where this step's amax is recorded, and
  // whether the scale comes from the history's amax in scale[2] instead.
  Fp8History::Slot history;
  // What the tensor's GEMMs read (set before PrepareFp8): the codes as stored (an FP8
  // activation GEMM reads them) and the grouped transposed ones (an FP8 weight-gradient GEMM).
  // Neither: nothing is quantised (every GEMM that reads the tensor runs in bf16).
  bool want_rows = false, want_columns = false;
  bool quantised() const { return want_rows || want_columns; }
  // Where the producer reduces the amax: the history slot under delayed scaling, else [1].
  float* amax() const {
    if (!amax_from_producer) return nullptr;
    return history.amax != nullptr ? history.amax : scale.as<float>() + 1;
  }
  // The amax QuantizeArgs::amax gets: the history's, the producer's, or none (computed).
  const float* scale_amax() const {
    return history.from_history ? scale.as<float>() + 2 : amax();
  }
  size_t bytes() const { return scale.size() + rows.size() + columns.size(); }
};

// What Forward keeps for Backward. Buffers are backend memory; layouts as in dispatch.h.
struct SavedStep : public StepContext {
  const void* layer = nullptr;
  bool used = false;
  int64_t tokens = 0;        // T on this rank
  double global_tokens = 0;  // T_g
  DType x_type = DType::kFloat32;
  std::vector<int64_t> global_counts;  // f [E]
  DispatchPlan plan;
  // [T, H] fp32 input (the router GEMMs: logits, d_gate); empty when x came as BF16, the
  // experts compute in BF16 or FP8 and the backend's GEMMs read x16 instead (GemmReadsBf16A).
  Buffer x32;
  // [T, H] x as it came when that was BF16, else empty: x32's exact bf16 form, which the
  // router GEMMs may read instead (GemmArgs::a_bf16) and the experts read when compute is BF16.
  Buffer x16;
  Buffer logits;       // [T, E]
  Buffer scores;       // [T, E]
  Buffer logsumexp;    // [T]
  Buffer topk_expert;  // [T, k] int32
  Buffer topk_weight;  // [T, k] fp32 probs
  Buffer pair_row;     // [T, k] int32 row in the local layout, -1 dropped
  Buffer x_expert;     // [expert_rows, H] compute dtype, expert layout (FP8: see x_fp8)
  Buffer h;            // [expert_rows, up] compute dtype, after the up bias
  Buffer act;          // [expert_rows, F] compute dtype (FP8: see act_fp8)
  Buffer y_local;      // [local_rows, H] compute dtype, local layout
  // FP8: the backward reads X_e and a only through the weight-gradient GEMMs, so the forward
  // keeps their grouped codes (the very codes its h and y GEMMs used; scale and columns only)
  // and frees x_expert and act: half their bytes, and no re-quantisation in the backward.
  Fp8Rows x_fp8, act_fp8;
  size_t bytes() const override {
    return x32.size() + x16.size() + logits.size() + scores.size() + logsumexp.size() +
           topk_expert.size() + topk_weight.size() + pair_row.size() + x_expert.size() + h.size() +
           act.size() + y_local.size() + x_fp8.bytes() + act_fp8.bytes();
  }
};

// The forward's own buffers, passed from stage to stage and freed when Forward returns (what
// Backward needs goes to SavedStep instead). Host fields that a stage uploads live here too:
// an upload may be asynchronous, and Forward's final download waits for it.
struct ForwardWork {
  Buffer x_compute;  // [T, H] x in BF16 when that is the compute dtype and x came as FP32
  const void* x_experts = nullptr;  // what the experts read: SavedStep::x32, x16 or x_compute
  // Step statistics, one buffer so that one copy brings them to the host:
  //   double [E + 2]: [0, E) sum_t P[t, e], [E] sum_t lse^2, [E + 1] tokens (T, then T_g)
  //   int32 [E]: (token, slot) pairs per expert before drops (local, then global f)
  //   int32 [E]: pairs kept per expert after the capacity drop (local)
  //   int32 [R, E]: every rank's kept pairs per expert, all-gathered (only when R > 1)
  Buffer stats;
  double local_tokens = 0;               // host source of stats' tokens entry
  Buffer kept;                           // [T, k] uint8: 1 when the pair survives capacity
  std::vector<double> loss_sums;         // [E + 2] host copy of stats' doubles (all-reduced)
  std::vector<int32_t> kept_counts;      // [E] host copy of stats' kept counts (local)
  std::vector<int32_t> all_kept_counts;  // [R, E] host copy of the all-gathered ones (R > 1)
  std::vector<int64_t> expert_offsets;   // [E + 1] block starts of the local layout (padded)
  Buffer y_expert;                       // [expert_rows, H] compute dtype, expert layout
};

// The backward's own buffers, passed from stage to stage (freed as soon as the next stage is
// done with them, so the peak stays that of the unsplit backward).
struct BackwardWork {
  Buffer d_y_local;   // [local_rows, H] compute dtype; reused for d_X's return (R > 1)
  Buffer d_probs;     // [T, k] fp32
  Buffer d_x_expert;  // [expert_rows, H] compute dtype
  Buffer d_x;         // [T, H] fp32, accumulated by Backward 4 and 6
  std::vector<float> aux_grad_host;  // [E] host source of aux_grad (uploads may be async)
  Buffer aux_grad;                   // [E] fp32 dL/dP, empty without an aux loss
  Buffer d_logits;                   // [T, E] fp32
};

// The operands of one backward's expert weight-gradient GEMMs (docs/SPEC.md Backward 3, "Weight
// gradients of several backwards"), kept instead of run, so that the GEMMs of several backwards
// run once over all their rows (MoeLayerImpl::FlushGradients): per expert one GEMM with k = the
// backwards' rows together, which reads and writes the fp32 gradient once instead of once per
// backward. The buffers are the backward's own (moved here, not copied), in the step's expert
// layout: expert el's rows are [offset_el, offset_el + group_rows[el]).
struct DeferredWeightGrads {
  std::vector<int64_t> group_rows;  // the step's rows per local expert, padding included
  Buffer x, d_h;                    // d_wi_e += X_e^T . d_h_e   ([rows, H], [rows, up])
  Buffer act, d_y;                  // d_wo_e += a_e^T . d_y_e   ([rows, F], [rows, H])
  size_t bytes() const { return x.size() + d_h.size() + act.size() + d_y.size(); }
};

// OK when `x` is [T, hidden] and FP32 or BF16; INVALID_ARGUMENT naming `field` else.
absl::Status CheckActivations(const char* field, const Tensor& x, int64_t hidden);

// OK when `into` is null or has this dtype and shape; INVALID_ARGUMENT naming `field` else.
absl::Status CheckOutputDestination(absl::string_view field, const Tensor* into, DType dtype,
                                    const std::vector<int64_t>& shape);

class MoeLayerImpl : public MoeLayer {
 public:
  MoeLayerImpl(const LayerConfig& config, Backend* backend, Communicator* comm);
  // Allocates and initialises every parameter; `cancelled` and `options` (checked) as in
  // MoeLayer::Create.
  absl::Status Init(const std::function<bool()>& cancelled, const MoeLayerOptions& options);

  const LayerConfig& config() const override { return config_; }
  int64_t first_expert() const override { return first_expert_; }
  int64_t local_experts() const override { return local_experts_; }
  Fp8GemmSet fp8_gemms() const override { return fp8_gemms_; }

  using MoeLayer::Backward;
  using MoeLayer::Forward;
  absl::StatusOr<ForwardResult> Forward(const Tensor& x, std::unique_ptr<StepContext>* saved,
                                        Tensor* out, bool routed_experts) override;
  absl::StatusOr<Tensor> Backward(StepContext& saved, const Tensor& d_out, double d_aux,
                                  double d_z_loss, Tensor* d_x) override;

  std::vector<std::string> ParameterNames() const override;
  absl::StatusOr<Tensor> GetParameter(const std::string& name) const override;
  absl::Status SetParameter(const std::string& name, const Tensor& value) override;
  absl::StatusOr<Tensor> GetGradient(const std::string& name) override;
  absl::Status ZeroGradients() override;
  absl::Status FlushGradients() override;
  absl::Status ApplyOptimizer(const OptimizerConfig& optimizer) override;
  absl::StatusOr<std::string> NonFiniteGradient() override;
  std::vector<std::string> StateNames() const override;
  absl::Status ResetOptimizerState() override;
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
  // Under FP8, which copies of weight `name` ("wi", "wo") its data GEMMs read: e4m3 codes
  // (compute, compute_t, compute_scale) and/or bf16 (compute_bf16). Neither otherwise.
  struct WeightCopies {
    bool codes = false, bf16 = false;
  };
  WeightCopies WeightCopiesOf(const std::string& name) const;
  absl::Status RefreshComputeCopy(LayerParam& p);
  // Writes the zeros of a lazily zeroed gradient (grad_zero) into its buffer.
  absl::Status MaterializeGradient(LayerParam& p);
  absl::StatusOr<Buffer> Upload(const void* host, size_t bytes);
  absl::StatusOr<Tensor> Download(const Buffer& buffer, DType dtype,
                                  const std::vector<int64_t>& shape) const;
  // Into `into` when non-null (its dtype and shape must be these; INVALID_ARGUMENT otherwise),
  // returning a copy of *into; else a new tensor.
  absl::StatusOr<Tensor> DownloadInto(const Buffer& buffer, DType dtype,
                                      const std::vector<int64_t>& shape, Tensor* into) const;
  // ---- Forward stages (moe_layer_forward.cc), in order ----
  // Uploads x. Writes s.x32 ([T, H] fp32, the router's view), s.x16 (x as it came, when
  // BF16) and w.x_compute / w.x_experts (the experts' view in the compute dtype).
  absl::Status UploadInput(const Tensor& x, SavedStep& s, ForwardWork& w);
  // Forward 1-6: logits and router, then the all-reduce of the step statistics. Reads s.x32
  // or s.x16; writes s.logits, s.scores, s.logsumexp, s.topk_expert, s.topk_weight, w.stats (its
  // per-expert counts and loss sums all-reduced; kept counts not yet written).
  absl::Status RouteTokens(SavedStep& s, ForwardWork& w);
  // Forward 7: the capacity drop, then one copy of w.stats to the host. Reads s.topk_expert,
  // s.topk_weight; writes w.kept,
  // w.loss_sums, w.kept_counts, s.global_tokens and s.global_counts. INVALID_ARGUMENT when
  // T_g exceeds int32 (on every rank alike).
  absl::Status DropOverCapacity(SavedStep& s, ForwardWork& w);
  // The row counts of Forward 8 (each expert's kept pairs padded to align_size) and 9 (all
  // ranks' counts all-gathered into A[R, E]). Reads w.kept_counts; writes w.expert_offsets and
  // s.plan. INVALID_ARGUMENT when a layout would exceed int32 rows (on every rank alike).
  absl::Status PlanRows(SavedStep& s, ForwardWork& w);
  // Forward 8-9: permute x's kept pairs into the local layout, then dispatch the rows to
  // their experts' owners. Reads s.topk_expert, s.plan, w.kept, w.expert_offsets,
  // w.x_experts; writes s.pair_row and s.x_expert (expert layout).
  absl::Status PermuteAndDispatch(SavedStep& s, ForwardWork& w);
  // Forward 10: the expert FFN (moe_layer_experts.cc). Reads s.plan, s.x_expert; writes s.h,
  // s.act and w.y_expert (FP8: s.x_fp8 and s.act_fp8, and frees s.x_expert).
  absl::Status ExpertsForward(SavedStep& s, ForwardWork& w);
  // Forward 11: return y to the local layout and combine it in slot order into x's dtype.
  // Reads s.plan, s.pair_row, s.topk_weight, w.y_expert (consumed); writes s.y_local and the
  // output (into `into` when non-null, as DownloadInto).
  absl::StatusOr<Tensor> CombineOutput(SavedStep& s, ForwardWork& w, Tensor* into);
  // Forward 5-6 values: aux and z-loss over T_g from w.loss_sums and s.global_counts, and
  // tokens_per_expert; adds s.global_counts to accumulated_counts_.
  void AddLosses(const SavedStep& s, const ForwardWork& w, ForwardResult& result);

  // ---- Backward stages (moe_layer_backward.cc), in order ----
  // Backward 1: reads d_out, s.y_local, s.pair_row, s.topk_weight, s.plan; writes
  // w.d_y_local and w.d_probs.
  absl::Status CombineBackward(const SavedStep& s, const Tensor& d_out, BackwardWork& w);
  // Backward 2-3: dispatch d_y as Forward 9 dispatched x, then the expert FFN backward
  // (accumulates the expert gradients). Reads w.d_y_local, s.plan and what
  // ExpertsBackward reads; writes w.d_x_expert.
  absl::Status DispatchExpertsBackward(SavedStep& s, BackwardWork& w);
  // Backward 4: return d_X to the local layout (into w.d_y_local), then
  // d_x_t = sum_j d_X_(t,j). Reads s.plan, s.pair_row, w.d_x_expert; writes w.d_x (fp32) and
  // frees w.d_y_local and w.d_x_expert.
  absl::Status ReturnExpertGradients(const SavedStep& s, BackwardWork& w);
  // Backward 5: reads s.logits, s.scores, s.logsumexp, s.topk_expert, s.global_tokens,
  // s.global_counts, w.d_probs; writes w.aux_grad_host, w.aux_grad, w.d_logits.
  absl::Status RouterBackward(const SavedStep& s, double d_aux, double d_z_loss, BackwardWork& w);
  // Backward 6: d_x += d_z . gate^T; d_gate += all-reduce(x^T . d_z). Reads s.tokens, s.x32
  // or s.x16, w.d_logits; updates w.d_x and the gate gradient.
  absl::Status GateBackward(const SavedStep& s, BackwardWork& w);
  // Backward's output: w.d_x cast to s.x_type (into `into` when non-null, as DownloadInto).
  absl::StatusOr<Tensor> DownloadInputGradient(const SavedStep& s, BackwardWork& w, Tensor* into);
  // When q.quantised(): `in` [rows, cols] (ExpertRowDType, the local experts' rows in
  // group_rows order) quantised as q.fp8 with one per-tensor scale into the layouts of q it
  // wants (allocated here; the amax from q.amax() when PrepareFp8 said so). Otherwise nothing.
  absl::Status QuantizeExpertRows(const std::vector<int64_t>& group_rows, const void* in,
                                  int64_t cols, Fp8Rows& q);
  // Under FP8, before the tensor t of `rows` rows is written (the producer's kernel, or the
  // quantisation's): allocates q.scale (its amax slot zeroed where a producer fills it), sets
  // q.amax_from_producer to
  // `producer_amax` (the producer then fills q.amax()), and under delayed scaling claims the
  // tensor's history slot (q.history; none for an empty tensor, which records nothing).
  // Nothing unless q.quantised() (which implies compute_dtype = FP8).
  absl::Status PrepareFp8(Fp8Tensor t, bool producer_amax, int64_t rows, Fp8Rows& q);
  // FP8 expert GEMMs (moe_layer_experts.cc), one per local expert, of
  // out = in . weights^T, `in` the codes as stored of a [rows, k] input, weights [El, n, k]
  // e4m3 codes with [El] scales. None when there are no rows.
  std::vector<GemmArgs> Fp8ExpertGemms(const std::vector<int64_t>& group_rows, const Fp8Rows& in,
                                       int64_t k, const void* weights, const float* weight_scales,
                                       int64_t n, void* out) const;
  // The experts' activation GEMMs (h, y, d_a, d_X; moe_layer_experts.cc) over every local
  // expert's rows: out_e = in_e . w_e with w_e stored [k, n], or with `transposed`
  // out_e = in_e . w_e^T with w_e stored [n, k]; in [rows, k] and out [rows, n] in
  // ExpertRowDType. When `gemm` is in fp8_gemms_, Fp8ExpertGemms on in_fp8
  // (QuantizeExpertRows of `in`) times w's codes laid out [n, k] (compute_t, or compute when
  // transposed); else in bf16 from w's compute copy (compute_bf16 under FP8). Returns the
  // GEMMs for the caller's GroupedGemm.
  std::vector<GemmArgs> ExpertDataGemms(Fp8Gemm gemm, const std::vector<int64_t>& group_rows,
                                        const void* in, const Fp8Rows& in_fp8, int64_t k,
                                        const LayerParam& w, bool transposed, int64_t n,
                                        void* out) const;
  // Backward 3's weight gradients (moe_layer_experts.cc): w.grad_e (+)= in_e^T . d_out_e
  // ([in_cols, rows_e] x [rows_e, out_cols], fp32) for every local expert, written (beta 0)
  // while w's gradient is lazily zero (LayerParam), which covers every expert's slice, k = 0
  // ones included. in [rows, in_cols] and d_out [rows, out_cols] in ExpertRowDType; when `gemm`
  // is in fp8_gemms_ their grouped codes (in_fp8.columns, d_out_fp8.columns) instead: per
  // expert an FP8 "TN" GEMM over its padded columns (the zero pads add nothing). Returns the
  // GEMMs for the caller's GroupedGemm; once they have run the caller clears w.grad_zero.
  std::vector<GemmArgs> ExpertWeightGradGemms(Fp8Gemm gemm, const std::vector<int64_t>& group_rows,
                                              const void* in, const Fp8Rows& in_fp8,
                                              int64_t in_cols, const void* d_out,
                                              const Fp8Rows& d_out_fp8, int64_t out_cols,
                                              const LayerParam& w) const;
  // Backward 3 (moe_layer_experts.cc): accumulates the expert gradients from d_y (expert
  // layout) and writes d_x_expert. Reads s.plan, s.x_expert, s.h, s.act (FP8: s.x_fp8,
  // s.act_fp8 instead of s.x_expert, s.act). When DeferWeightGradients says so, the weight
  // gradients' GEMMs are not run: s.x_expert, s.act, d_y and d_h move to deferred_ instead;
  // the backward that brings deferred_ to its budget then runs every deferred step's weight
  // gradients (its own included) beside its data gradients and empties deferred_.
  absl::Status ExpertsBackward(SavedStep& s, Buffer& d_y, void* d_x_expert);
  // Whether a backward whose weight-gradient operands take `step_bytes` defers its GEMMs: never
  // under FP8 or with a zero budget; else when others are already deferred (the step joins
  // them) or when the step alone stays under the budget. A step that alone fills the budget
  // runs its GEMMs at once, beside the data gradients' (BackwardPhaseGemms), as without
  // deferral.
  bool DeferWeightGradients(size_t step_bytes) const;
  // The weight-gradient GEMMs of w (ExpertWeightGradGemms) over every deferred backward's rows
  // together, operands `in` [rows, in_cols] and `d_out` [rows, out_cols] of each: one deferred
  // backward's own buffers, or with several both gathered into `gathered` expert by expert
  // (step order within an expert: one GEMM per expert with k = its rows of every step).
  // Written (beta 0) while w's gradient is lazily zero. `gathered` must outlive the GEMMs'
  // enqueueing.
  absl::StatusOr<std::vector<GemmArgs>> DeferredWeightGradGemms(
      const LayerParam& w, Buffer DeferredWeightGrads::*in, int64_t in_cols,
      Buffer DeferredWeightGrads::*d_out, int64_t out_cols, Buffer (&gathered)[2]);
  // FlushGradients' GEMMs: d_wo's over the deferred rows, then d_wi's.
  absl::Status RunDeferredWeightGrads();

  bool Fp8(Fp8Gemm g) const { return Fp8GemmIn(fp8_gemms_, g); }

  const LayerConfig config_;
  Backend* const backend_;
  Communicator* const comm_;
  const int rank_, ranks_;
  const int64_t local_experts_, first_expert_;
  std::vector<LayerParam> params_;           // gate, [expert_bias], wi, wo, [wi_bias, wo_bias]
  int64_t optimizer_step_ = 0;               // AdamW step count; 0 = no state yet
  std::vector<int64_t> accumulated_counts_;  // [E] global counts since UpdateExpertBias
  // Backwards whose expert weight gradients are not yet in wi/wo's `grad` (DeferredWeightGrads,
  // in call order), their bytes, and the budget above which a backward flushes them (a
  // fraction of wi and wo's gradient bytes, set by Init).
  std::vector<DeferredWeightGrads> deferred_;
  size_t deferred_bytes_ = 0;
  size_t deferred_budget_bytes_ = 0;
  // Delayed FP8 scaling's amax histories (empty unless FP8 with the delayed recipe); emptied
  // by SetParameter (SetWeights, a checkpoint's weights before its state).
  Fp8History fp8_history_;
  // config_.fp8_gemms resolved on backend_ by Init (MoeLayer::fp8_gemms).
  Fp8GemmSet fp8_gemms_ = 0;
};

}  // namespace moe

#endif  // MOED_ENGINE_MOE_LAYER_IMPL_H_
