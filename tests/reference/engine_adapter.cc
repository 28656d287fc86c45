// Test-only glue between the engine and the reference.
#include "tests/reference/engine_adapter.h"

#include <utility>

#include "engine/comm/local_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/status_macros.h"

namespace moe_ref {

std::vector<double> RandomNormal(int64_t n, double scale, std::mt19937_64* rng) {
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = dist(*rng);
  return v;
}

RefConfig FromLayerConfig(const moe::LayerConfig& c) {
  RefConfig r;
  r.hidden = c.hidden;
  r.ffn = c.ffn;
  r.num_experts = c.num_experts;
  r.top_k = c.top_k;
  r.score =
      c.score_function == moe::ScoreFunction::kSoftmax ? RefScore::kSoftmax : RefScore::kSigmoid;
  r.pre_softmax = c.pre_softmax;
  r.num_groups = c.num_groups;
  r.group_topk = c.group_topk;
  r.scaling_factor = c.scaling_factor;
  r.use_expert_bias = c.use_expert_bias;
  r.aux_loss_coeff = c.aux_loss_coeff;
  r.z_loss_coeff = c.z_loss_coeff;
  r.capacity_factor = c.capacity_factor;
  switch (c.activation) {
    case moe::Activation::kSilu:
      r.activation = RefActivation::kSilu;
      break;
    case moe::Activation::kGelu:
      r.activation = RefActivation::kGelu;
      break;
    case moe::Activation::kRelu:
      r.activation = RefActivation::kRelu;
      break;
    case moe::Activation::kLinear:
      r.activation = RefActivation::kLinear;
      break;
  }
  r.gated = c.gated;
  r.use_bias = c.use_bias;
  return r;
}

std::vector<double> ToDoubles(const moe::Tensor& tensor) {
  std::vector<double> out(tensor.num_elements());
  for (int64_t i = 0; i < tensor.num_elements(); ++i) {
    out[i] = tensor.dtype() == moe::DType::kFloat64 ? tensor.data<double>()[i] : tensor.GetFloat(i);
  }
  return out;
}

moe::Tensor FromDoubles(const std::vector<double>& values, std::vector<int64_t> shape,
                        moe::DType dtype) {
  moe::Tensor t = moe::Tensor::Zeros(moe::DType::kFloat32, std::move(shape));
  for (size_t i = 0; i < values.size(); ++i) t.data<float>()[i] = static_cast<float>(values[i]);
  return t.ConvertTo(dtype);
}

absl::StatusOr<RefParams> ReadParams(const moe::MoeLayer& layer) {
  const moe::LayerConfig& c = layer.config();
  if (layer.local_experts() != c.num_experts) {
    return absl::FailedPreconditionError("ReadParams needs every expert local (EP = 1)");
  }
  RefParams p = RefParams::Zeros(FromLayerConfig(c));
  auto read = [&](const char* name, std::vector<double>* out) -> absl::Status {
    ASSIGN_OR_RETURN(moe::Tensor t, layer.GetParameter(name));
    std::vector<double> values = ToDoubles(t);
    if (values.size() != out->size()) {
      return absl::InternalError(std::string("unexpected size of parameter ") + name);
    }
    *out = std::move(values);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(read("gate", &p.gate));
  RETURN_IF_ERROR(read("wi", &p.wi));
  RETURN_IF_ERROR(read("wo", &p.wo));
  if (c.use_bias) {
    RETURN_IF_ERROR(read("wi_bias", &p.wi_bias));
    RETURN_IF_ERROR(read("wo_bias", &p.wo_bias));
  }
  if (c.use_expert_bias) RETURN_IF_ERROR(read("expert_bias", &p.expert_bias));
  return p;
}

absl::Status WriteParams(const RefParams& p, moe::MoeLayer* layer) {
  const moe::LayerConfig& c = layer->config();
  const int64_t H = c.hidden, F = c.ffn, E = c.num_experts, up = moe::UpWidth(c);
  const moe::DType f32 = moe::DType::kFloat32;
  RETURN_IF_ERROR(layer->SetParameter("gate", FromDoubles(p.gate, {H, E}, f32)));
  RETURN_IF_ERROR(layer->SetParameter("wi", FromDoubles(p.wi, {E, H, up}, f32)));
  RETURN_IF_ERROR(layer->SetParameter("wo", FromDoubles(p.wo, {E, F, H}, f32)));
  if (c.use_bias) {
    RETURN_IF_ERROR(layer->SetParameter("wi_bias", FromDoubles(p.wi_bias, {E, up}, f32)));
    RETURN_IF_ERROR(layer->SetParameter("wo_bias", FromDoubles(p.wo_bias, {E, H}, f32)));
  }
  if (c.use_expert_bias) {
    RETURN_IF_ERROR(layer->SetParameter("expert_bias", FromDoubles(p.expert_bias, {E}, f32)));
  }
  return absl::OkStatus();
}

absl::StatusOr<RefGradients> ReadGradients(moe::MoeLayer& layer) {
  const moe::LayerConfig& c = layer.config();
  RefParams zeros = RefParams::Zeros(FromLayerConfig(c));
  RefGradients g;
  g.d_wi_bias = zeros.wi_bias;
  g.d_wo_bias = zeros.wo_bias;
  ASSIGN_OR_RETURN(moe::Tensor gate, layer.GetGradient("gate"));
  ASSIGN_OR_RETURN(moe::Tensor wi, layer.GetGradient("wi"));
  ASSIGN_OR_RETURN(moe::Tensor wo, layer.GetGradient("wo"));
  g.d_gate = ToDoubles(gate);
  g.d_wi = ToDoubles(wi);
  g.d_wo = ToDoubles(wo);
  if (c.use_bias) {
    ASSIGN_OR_RETURN(moe::Tensor wi_bias, layer.GetGradient("wi_bias"));
    ASSIGN_OR_RETURN(moe::Tensor wo_bias, layer.GetGradient("wo_bias"));
    g.d_wi_bias = ToDoubles(wi_bias);
    g.d_wo_bias = ToDoubles(wo_bias);
  }
  return g;
}

absl::StatusOr<CpuLayer> MakeCpuLayer(const moe::LayerConfig& config,
                                      const moe::MoeLayerOptions& options) {
  CpuLayer out;
  out.backend = moe::MakeCpuBackend();
  out.comm = moe::MakeLocalCommunicator(moe::MemorySpace::kHost);
  ASSIGN_OR_RETURN(out.layer, moe::MoeLayer::Create(config, out.backend.get(), out.comm.get(),
                                                    /*cancelled=*/nullptr, options));
  return out;
}

absl::StatusOr<EngineStep> RunStep(moe::MoeLayer* layer, const moe::Tensor& x,
                                   const moe::Tensor* d_out, double d_aux, double d_zl) {
  EngineStep step;
  std::unique_ptr<moe::StepContext> saved;
  ASSIGN_OR_RETURN(step.forward, layer->Forward(x, d_out != nullptr ? &saved : nullptr));
  if (d_out != nullptr) {
    ASSIGN_OR_RETURN(step.d_x, layer->Backward(*saved, *d_out, d_aux, d_zl));
  }
  return step;
}

}  // namespace moe_ref
