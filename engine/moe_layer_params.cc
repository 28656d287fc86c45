// MoeLayer creation, parameters, gradients, optimizer state and updates (docs/SPEC.md
// "Parameters", "Initialisation", "Updates").
#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/init.h"
#include "engine/moe_layer_impl.h"
#include "engine/status_macros.h"

namespace moe {

absl::StatusOr<std::unique_ptr<MoeLayer>> MoeLayer::Create(const LayerConfig& config,
                                                           Backend* backend, Communicator* comm,
                                                           const std::function<bool()>& cancelled,
                                                           const MoeLayerOptions& options) {
  if (backend == nullptr || comm == nullptr) {
    return absl::InvalidArgumentError("MoeLayer::Create: backend and communicator are required");
  }
  RETURN_IF_ERROR(ValidateConfig(config, comm->size()));
  RETURN_IF_ERROR(CheckDeferredWgradFraction(options.deferred_wgrad_fraction));
  if (comm->memory_space() != backend->memory_space()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MoeLayer::Create: communicator '", comm->name(), "' and backend '", backend->name(),
        "' use different memory spaces"));
  }
  auto layer = std::make_unique<MoeLayerImpl>(config, backend, comm);
  RETURN_IF_ERROR(layer->Init(cancelled, options));
  return std::unique_ptr<MoeLayer>(std::move(layer));
}

MoeLayerImpl::MoeLayerImpl(const LayerConfig& config, Backend* backend, Communicator* comm)
    : config_(config),
      backend_(backend),
      comm_(comm),
      rank_(comm->rank()),
      ranks_(comm->size()),
      local_experts_(config.num_experts / comm->size()),
      first_expert_(comm->rank() * (config.num_experts / comm->size())),
      accumulated_counts_(config.num_experts, 0) {}

absl::Status MoeLayerImpl::Init(const std::function<bool()>& cancelled,
                                const MoeLayerOptions& options) {
  const LayerConfig& c = config_;
  RETURN_IF_ERROR(backend_->CheckComputeDType(c));
  const int64_t H = c.hidden, E = c.num_experts, F = c.ffn, up = UpWidth(c), El = local_experts_;
  fp8_gemms_ = ResolveFp8Gemms(c, *backend_);
  const bool low_precision = c.compute_dtype != DType::kFloat32;
  // Expert tensors are initialised in groups of experts of about 4 MiB, each copied into the
  // master at its offset: the host holds one group at a time, and `cancelled` is polled
  // between groups.
  using InitExperts = std::vector<float> (*)(const LayerConfig&, int64_t, int64_t);
  struct ExpertInit {
    InitExperts fn;
    int64_t per_expert;  // elements
  };
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool has_grad,
                 bool compute_copy, const std::vector<float>* init,
                 const ExpertInit* experts) -> absl::Status {
    LayerParam p;
    p.name = name;
    p.shape = std::move(shape);
    p.has_grad = has_grad;
    p.has_compute_copy = compute_copy && low_precision;
    const size_t bytes = static_cast<size_t>(p.count()) * sizeof(float);
    ASSIGN_OR_RETURN(p.master, backend_->Allocate(bytes));
    if (init != nullptr) {
      RETURN_IF_ERROR(backend_->CopyFromHost(p.master.data(), init->data(), bytes));
    } else if (experts != nullptr) {
      const int64_t group = std::max<int64_t>(1, (int64_t{1} << 20) / experts->per_expert);
      for (int64_t e = 0; e < El; e += group) {
        if (cancelled != nullptr && cancelled()) {
          return absl::CancelledError(absl::StrCat("layer initialisation cancelled after ", e,
                                                   " of ", El, " experts"));
        }
        const int64_t n = std::min(group, El - e);
        const std::vector<float> values = experts->fn(c, first_expert_ + e, n);
        RETURN_IF_ERROR(backend_->CopyFromHost(
            static_cast<char*>(p.master.data()) + e * experts->per_expert * sizeof(float),
            values.data(), values.size() * sizeof(float)));
      }
    } else {
      RETURN_IF_ERROR(backend_->Memset(p.master.data(), 0, bytes));
    }
    if (has_grad) {
      ASSIGN_OR_RETURN(p.grad, backend_->Allocate(bytes));  // zero by grad_zero
    }
    if (p.has_compute_copy) {
      const WeightCopies copies = WeightCopiesOf(name);
      if (c.compute_dtype != DType::kFloat8E4M3) {
        ASSIGN_OR_RETURN(p.compute, backend_->Allocate(p.count() * DTypeSize(c.compute_dtype)));
      }
      if (copies.codes) {
        ASSIGN_OR_RETURN(p.compute, backend_->Allocate(p.count()));
        ASSIGN_OR_RETURN(p.compute_t, backend_->Allocate(p.count()));
        ASSIGN_OR_RETURN(p.compute_scale,
                         backend_->Allocate(p.shape[0] * kFp8ScaleStride * sizeof(float)));
      }
      if (copies.bf16) {
        ASSIGN_OR_RETURN(p.compute_bf16,
                         backend_->Allocate(p.count() * DTypeSize(DType::kBFloat16)));
      }
      RETURN_IF_ERROR(RefreshComputeCopy(p));
    }
    params_.push_back(std::move(p));
    return absl::OkStatus();
  };
  const std::vector<float> gate = InitGate(c);
  RETURN_IF_ERROR(add("gate", {H, E}, true, false, &gate, nullptr));
  if (c.use_expert_bias) {
    RETURN_IF_ERROR(add("expert_bias", {E}, false, false, nullptr, nullptr));
  }
  const ExpertInit wi{&InitWi, H * up}, wo{&InitWo, F * H};
  RETURN_IF_ERROR(add("wi", {El, H, up}, true, true, nullptr, &wi));
  RETURN_IF_ERROR(add("wo", {El, F, H}, true, true, nullptr, &wo));
  if (c.use_bias) {
    RETURN_IF_ERROR(add("wi_bias", {El, up}, true, false, nullptr, nullptr));
    RETURN_IF_ERROR(add("wo_bias", {El, H}, true, false, nullptr, nullptr));
  }
  deferred_budget_bytes_ = static_cast<size_t>(
      DeferredWgradBudgetBytes(c, comm_->size(), options.deferred_wgrad_fraction));
  ASSIGN_OR_RETURN(fp8_history_, Fp8History::Create(c, backend_));
  return backend_->Synchronize();
}

LayerParam* MoeLayerImpl::Find(const std::string& name) {
  for (LayerParam& p : params_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

const LayerParam* MoeLayerImpl::Find(const std::string& name) const {
  for (const LayerParam& p : params_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

MoeLayerImpl::WeightCopies MoeLayerImpl::WeightCopiesOf(const std::string& name) const {
  WeightCopies copies;
  if (config_.compute_dtype != DType::kFloat8E4M3) return copies;
  // The data GEMMs that read the weight (its weight gradient reads no weight).
  const bool wi = name == "wi";
  const bool fprop = Fp8(wi ? Fp8Gemm::kFc1Fprop : Fp8Gemm::kFc2Fprop);
  const bool dgrad = Fp8(wi ? Fp8Gemm::kFc1Dgrad : Fp8Gemm::kFc2Dgrad);
  copies.codes = fprop || dgrad;
  copies.bf16 = !fprop || !dgrad;
  return copies;
}

absl::Status MoeLayerImpl::RefreshComputeCopy(LayerParam& p) {
  if (!p.has_compute_copy) return absl::OkStatus();
  if (p.compute_bf16.data() != nullptr) {  // FP8 layer, bf16 GEMMs: the BF16 layer's conversion
    RETURN_IF_ERROR(backend_->Convert(p.master.data(), DType::kFloat32, p.compute_bf16.data(),
                                      DType::kBFloat16, p.count()));
  }
  if (config_.compute_dtype == DType::kFloat8E4M3) {
    if (p.compute.data() == nullptr) return absl::OkStatus();  // every data GEMM of p in bf16
    // Per expert [r, c]: the codes as stored, then transposed; both get the same scales.
    QuantizeArgs q;
    q.src = p.master.data(), q.src_type = DType::kFloat32;
    q.batch = p.shape[0], q.rows = p.shape[1], q.cols = p.shape[2];
    q.fp8 = DType::kFloat8E4M3;
    q.dst = p.compute.data(), q.scale = p.compute_scale.as<float>();
    q.scale_stride = kFp8ScaleStride;  // each expert's scale 16-byte aligned for its GEMM
    RETURN_IF_ERROR(backend_->QuantizeFp8(q));
    q.transpose = true;
    q.dst = p.compute_t.data();
    return backend_->QuantizeFp8(q);
  }
  return backend_->Convert(p.master.data(), DType::kFloat32, p.compute.data(),
                           config_.compute_dtype, p.count());
}

absl::Status MoeLayerImpl::MaterializeGradient(LayerParam& p) {
  if (!p.has_grad || !p.grad_zero) return absl::OkStatus();
  RETURN_IF_ERROR(backend_->Memset(p.grad.data(), 0, p.grad.size()));
  p.grad_zero = false;
  return absl::OkStatus();
}

absl::StatusOr<Buffer> MoeLayerImpl::Upload(const void* host, size_t bytes) {
  ASSIGN_OR_RETURN(Buffer b, backend_->Allocate(bytes));
  RETURN_IF_ERROR(backend_->CopyFromHost(b.data(), host, bytes));
  return b;
}

absl::StatusOr<Tensor> MoeLayerImpl::Download(const Buffer& buffer, DType dtype,
                                              const std::vector<int64_t>& shape) const {
  Tensor t = Tensor::Uninitialized(dtype, shape);  // CopyToHost writes every byte
  if (t.num_bytes() > buffer.size()) {
    return absl::InternalError("Download: buffer smaller than the tensor");
  }
  RETURN_IF_ERROR(backend_->CopyToHost(t.raw(), buffer.data(), t.num_bytes()));
  return t;
}

absl::Status CheckOutputDestination(absl::string_view field, const Tensor* into, DType dtype,
                                    const std::vector<int64_t>& shape) {
  if (into == nullptr || (into->dtype() == dtype && into->shape() == shape)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": the destination is ", DTypeName(into->dtype()), " ", into->ShapeString(),
      ", the output is ", DTypeName(dtype), " [", absl::StrJoin(shape, ", "), "]"));
}

absl::StatusOr<Tensor> MoeLayerImpl::DownloadInto(const Buffer& buffer, DType dtype,
                                                  const std::vector<int64_t>& shape,
                                                  Tensor* into) const {
  if (into == nullptr) return Download(buffer, dtype, shape);
  RETURN_IF_ERROR(CheckOutputDestination("output", into, dtype, shape));
  if (into->num_bytes() > buffer.size()) {
    return absl::InternalError("Download: buffer smaller than the tensor");
  }
  RETURN_IF_ERROR(backend_->CopyToHost(into->raw(), buffer.data(), into->num_bytes()));
  return *into;
}

std::vector<std::string> MoeLayerImpl::ParameterNames() const {
  std::vector<std::string> names;
  for (const LayerParam& p : params_) names.push_back(p.name);
  return names;
}

absl::StatusOr<Tensor> MoeLayerImpl::GetParameter(const std::string& name) const {
  const LayerParam* p = Find(name);
  if (p == nullptr) {
    return absl::NotFoundError(absl::StrCat("parameter '", name, "' does not exist (have: ",
                                            absl::StrJoin(ParameterNames(), ", "), ")"));
  }
  return Download(p->master, DType::kFloat32, p->shape);
}

absl::Status MoeLayerImpl::SetParameter(const std::string& name, const Tensor& value) {
  LayerParam* p = Find(name);
  if (p == nullptr) {
    return absl::NotFoundError(absl::StrCat("parameter '", name, "' does not exist (have: ",
                                            absl::StrJoin(ParameterNames(), ", "), ")"));
  }
  RETURN_IF_ERROR(CheckShape(name, value.shape(), p->shape));
  if (value.dtype() != DType::kFloat32 && value.dtype() != DType::kBFloat16 &&
      value.dtype() != DType::kFloat64) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": datatype must be FP32, BF16 or FP64, got ", DTypeName(value.dtype())));
  }
  const Tensor f32 = value.ConvertTo(DType::kFloat32);
  RETURN_IF_ERROR(backend_->CopyFromHost(p->master.data(), f32.raw(), f32.num_bytes()));
  RETURN_IF_ERROR(RefreshComputeCopy(*p));
  // New weights, new activations: delayed FP8 scales start again from the next step's amax.
  RETURN_IF_ERROR(fp8_history_.Reset());
  return backend_->Synchronize();
}

absl::StatusOr<Tensor> MoeLayerImpl::GetGradient(const std::string& name) {
  const LayerParam* p = Find(name);
  if (p == nullptr || !p->has_grad) {
    return absl::NotFoundError(absl::StrCat("parameter '", name, "' has no gradient"));
  }
  if (name == "wi" || name == "wo") RETURN_IF_ERROR(FlushGradients());
  if (p->grad_zero) return Tensor::Zeros(DType::kFloat32, p->shape);
  return Download(p->grad, DType::kFloat32, p->shape);
}

absl::Status MoeLayerImpl::ZeroGradients() {
  // Lazy (LayerParam): the next backward overwrites instead of accumulating. The deferred
  // weight-gradient operands would add to what is being zeroed: dropped.
  deferred_.clear();
  deferred_bytes_ = 0;
  for (LayerParam& p : params_) p.grad_zero = true;
  return absl::OkStatus();
}

absl::Status MoeLayerImpl::ApplyOptimizer(const OptimizerConfig& o) {
  const bool adamw = o.kind == OptimizerConfig::Kind::kAdamW;
  if (!std::isfinite(o.lr) || o.lr < 0 || !std::isfinite(o.weight_decay) || o.weight_decay < 0 ||
      !std::isfinite(o.momentum) || o.momentum < 0 || o.momentum >= 1 ||
      !std::isfinite(o.grad_scale) || !(o.grad_scale > 0) ||
      (adamw &&
       (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1) || !(o.eps > 0)))) {
    return absl::InvalidArgumentError(
        "optimizer: lr, weight_decay >= 0; momentum, beta1, beta2 in [0, 1); eps, grad_scale > "
        "0");
  }
  Backend::OptimizerArgs args;
  args.adamw = adamw;
  args.lr = o.lr;
  args.momentum = o.momentum;
  args.beta1 = o.beta1;
  args.beta2 = o.beta2;
  args.eps = o.eps;
  args.weight_decay = o.weight_decay;
  args.grad_scale = o.grad_scale;
  if (adamw) args.step = ++optimizer_step_;
  const bool needs_m = adamw || o.momentum != 0.0;
  RETURN_IF_ERROR(FlushGradients());
  for (LayerParam& p : params_) {
    if (!p.has_grad) continue;
    const size_t bytes = p.master.size();
    if (needs_m && p.m.data() == nullptr) {
      ASSIGN_OR_RETURN(p.m, backend_->Allocate(bytes));
      RETURN_IF_ERROR(backend_->Memset(p.m.data(), 0, bytes));
    }
    if (adamw && p.v.data() == nullptr) {
      ASSIGN_OR_RETURN(p.v, backend_->Allocate(bytes));
      RETURN_IF_ERROR(backend_->Memset(p.v.data(), 0, bytes));
    }
    // A step without a backward since the last zeroing still decays and moves the weights.
    RETURN_IF_ERROR(MaterializeGradient(p));
    RETURN_IF_ERROR(backend_->OptimizerStep(args, p.master.as<float>(), p.grad.as<float>(),
                                            needs_m ? p.m.as<float>() : nullptr,
                                            adamw ? p.v.as<float>() : nullptr, p.count()));
    RETURN_IF_ERROR(RefreshComputeCopy(p));
  }
  RETURN_IF_ERROR(ZeroGradients());
  return backend_->Synchronize();
}

absl::StatusOr<std::string> MoeLayerImpl::NonFiniteGradient() {
  RETURN_IF_ERROR(FlushGradients());
  for (const LayerParam& p : params_) {
    if (!p.has_grad || p.grad_zero) continue;  // a lazily zeroed gradient is finite
    bool finite = true;
    RETURN_IF_ERROR(backend_->AllFinite(p.grad.as<float>(), p.count(), &finite));
    if (!finite) return p.name;
  }
  return std::string();
}

absl::Status MoeLayerImpl::ResetOptimizerState() {
  for (LayerParam& p : params_) {
    p.m.Reset();
    p.v.Reset();
  }
  optimizer_step_ = 0;
  return absl::OkStatus();
}

std::vector<std::string> MoeLayerImpl::StateNames() const {
  std::vector<std::string> names;
  for (const LayerParam& p : params_) {
    if (p.m.data() != nullptr) names.push_back(p.name + ".m");
    if (p.v.data() != nullptr) names.push_back(p.name + ".v");
  }
  if (optimizer_step_ > 0) names.push_back("step");
  for (const std::string& name : fp8_history_.StateNames()) names.push_back(name);
  return names;
}

absl::StatusOr<Tensor> MoeLayerImpl::GetState(const std::string& name) const {
  if (absl::StartsWith(name, "fp8.")) return fp8_history_.GetState(name);
  if (name == "step" && optimizer_step_ > 0) {
    return Tensor::FromFloats({1}, {static_cast<float>(optimizer_step_)});
  }
  const size_t dot = name.rfind('.');
  const LayerParam* p = dot == std::string::npos ? nullptr : Find(name.substr(0, dot));
  if (p != nullptr) {
    const std::string which = name.substr(dot + 1);
    if (which == "m" && p->m.data() != nullptr) return Download(p->m, DType::kFloat32, p->shape);
    if (which == "v" && p->v.data() != nullptr) return Download(p->v, DType::kFloat32, p->shape);
  }
  return absl::NotFoundError(absl::StrCat("optimizer state '", name, "' does not exist"));
}

absl::Status MoeLayerImpl::SetState(const std::string& name, const Tensor& value) {
  if (absl::StartsWith(name, "fp8.")) return fp8_history_.SetState(name, value);
  if (value.dtype() != DType::kFloat32 && value.dtype() != DType::kBFloat16 &&
      value.dtype() != DType::kFloat64) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": datatype must be FP32, BF16 or FP64, got ", DTypeName(value.dtype())));
  }
  if (name == "step") {
    RETURN_IF_ERROR(CheckShape(name, value.shape(), {1}));
    const double step = value.GetFloat(0);
    // The bound keeps the conversion to int64 defined (1e30 became a negative step count).
    if (!(step >= 0) || step != std::floor(step) || step > 0x1p62) {
      return absl::InvalidArgumentError("step: must be a non-negative integer <= 2^62");
    }
    optimizer_step_ = static_cast<int64_t>(step);
    return absl::OkStatus();
  }
  const size_t dot = name.rfind('.');
  LayerParam* p = dot == std::string::npos ? nullptr : Find(name.substr(0, dot));
  const std::string which = dot == std::string::npos ? "" : name.substr(dot + 1);
  if (p == nullptr || !p->has_grad || (which != "m" && which != "v")) {
    return absl::NotFoundError(absl::StrCat("optimizer state '", name,
                                            "' is not a valid name (<param>.m, <param>.v, step)"));
  }
  RETURN_IF_ERROR(CheckShape(name, value.shape(), p->shape));
  Buffer& slot = which == "m" ? p->m : p->v;
  if (slot.data() == nullptr) {
    ASSIGN_OR_RETURN(slot, backend_->Allocate(p->master.size()));
  }
  const Tensor f32 = value.ConvertTo(DType::kFloat32);
  RETURN_IF_ERROR(backend_->CopyFromHost(slot.data(), f32.raw(), f32.num_bytes()));
  return backend_->Synchronize();
}

absl::Status MoeLayerImpl::UpdateExpertBias(double rate) {
  LayerParam* bias = Find("expert_bias");
  if (bias == nullptr) {
    return absl::FailedPreconditionError("UpdateExpertBias: the layer has no expert_bias "
                                         "(use_expert_bias=false)");
  }
  if (!std::isfinite(rate)) return absl::InvalidArgumentError("UpdateExpertBias: rate not finite");
  const int64_t E = config_.num_experts;
  std::vector<float> b(E);
  RETURN_IF_ERROR(backend_->CopyToHost(b.data(), bias->master.data(), E * sizeof(float)));
  double mean = 0;
  for (int64_t f : accumulated_counts_) mean += static_cast<double>(f);
  mean /= static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    const double diff = mean - static_cast<double>(accumulated_counts_[e]);
    const double sign = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
    b[e] = static_cast<float>(b[e] + rate * sign);
  }
  RETURN_IF_ERROR(backend_->CopyFromHost(bias->master.data(), b.data(), E * sizeof(float)));
  std::fill(accumulated_counts_.begin(), accumulated_counts_.end(), 0);
  return backend_->Synchronize();
}

}  // namespace moe
