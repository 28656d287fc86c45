// Smoke test of MoeLayer on the CPU backend with the local communicator: forward and backward
// run at the TE tiny shape, are bit-identical across runs, handle T = 0, and enforce the
// one-backward-per-context rule and input validation.
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/comm/local_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/moe_layer.h"
#include "gtest/gtest.h"
#include "tests/engine/tiny_config.h"

namespace moe {
namespace {

LayerConfig Tiny() {
  LayerConfig c = TinyLayerConfig();
  c.aux_loss_coeff = 1e-2;
  c.z_loss_coeff = 1e-3;
  c.init_seed = 7;
  return c;
}

Tensor Input(int64_t tokens, int64_t hidden, uint32_t seed) {
  std::vector<float> v(tokens * hidden);
  uint32_t s = seed;
  for (float& f : v) {
    s = s * 1664525u + 1013904223u;
    f = static_cast<float>((s >> 8) & 0xffff) / 65536.0f * 2.0f - 1.0f;
  }
  return Tensor::FromFloats({tokens, hidden}, v);
}

struct Step {
  ForwardResult fwd;
  Tensor d_x;
  std::vector<Tensor> grads;
};

Step RunStep(const LayerConfig& c, const Tensor& x, const Tensor& d_out) {
  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(c, backend.get(), comm.get());
  EXPECT_TRUE(layer.ok()) << layer.status();
  std::unique_ptr<StepContext> saved;
  Step step;
  auto fwd = (*layer)->Forward(x, &saved);
  EXPECT_TRUE(fwd.ok()) << fwd.status();
  step.fwd = *std::move(fwd);
  auto d_x = (*layer)->Backward(*saved, d_out, 1.0, 1.0);
  EXPECT_TRUE(d_x.ok()) << d_x.status();
  step.d_x = *std::move(d_x);
  for (const std::string& name : (*layer)->ParameterNames()) {
    auto g = (*layer)->GetGradient(name);
    if (g.ok()) step.grads.push_back(*std::move(g));
  }
  return step;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && a.bytes() == b.bytes();
}

TEST(MoeLayerSmokeTest, TinyForwardBackwardIsBitIdentical) {
  const LayerConfig c = Tiny();
  const Tensor x = Input(32, 32, 1), d_out = Input(32, 32, 2);
  const Step a = RunStep(c, x, d_out), b = RunStep(c, x, d_out);
  ASSERT_EQ(a.fwd.out.shape(), (std::vector<int64_t>{32, 32}));
  EXPECT_TRUE(SameBytes(a.fwd.out, b.fwd.out));
  EXPECT_TRUE(SameBytes(a.d_x, b.d_x));
  EXPECT_EQ(a.fwd.aux_loss, b.fwd.aux_loss);
  EXPECT_EQ(a.fwd.z_loss, b.fwd.z_loss);
  ASSERT_EQ(a.grads.size(), 3u);  // gate, wi, wo
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(SameBytes(a.grads[i], b.grads[i]));
  // Sanity: every token routed to k experts, non-trivial outputs and gradients.
  int64_t pairs = 0;
  for (int64_t n : a.fwd.tokens_per_expert) pairs += n;
  EXPECT_EQ(pairs, 32 * 2);
  EXPECT_GT(a.fwd.aux_loss, 0.0);
  EXPECT_GT(a.fwd.z_loss, 0.0);
  double out_norm = 0, gate_grad_norm = 0;
  for (int64_t i = 0; i < a.fwd.out.num_elements(); ++i) out_norm += std::fabs(a.fwd.out.GetFloat(i));
  for (int64_t i = 0; i < a.grads[0].num_elements(); ++i) {
    gate_grad_norm += std::fabs(a.grads[0].GetFloat(i));
  }
  EXPECT_GT(out_norm, 0.0);
  EXPECT_GT(gate_grad_norm, 0.0);
}

// Forward and Backward into a caller's buffer (Tensor::View: shared memory, pinned staging)
// write the same bits as into their own tensors; a destination of the wrong shape or dtype is
// refused before the step does anything (the backward's context stays usable).
TEST(MoeLayerSmokeTest, OutputsIntoCallerBuffersAreBitIdentical) {
  const LayerConfig c = Tiny();
  const Tensor x = Input(24, c.hidden, 5), d_out = Input(24, c.hidden, 6);
  const Step plain = RunStep(c, x, d_out);

  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(c, backend.get(), comm.get());
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<float> out_bytes(24 * c.hidden, -1.0f), d_x_bytes(24 * c.hidden, -1.0f);
  Tensor out = Tensor::View(DType::kFloat32, {24, c.hidden}, out_bytes.data());
  Tensor wrong = Tensor::View(DType::kFloat32, {23, c.hidden}, out_bytes.data());
  std::unique_ptr<StepContext> saved;
  EXPECT_EQ((*layer)->Forward(x, &saved, &wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto fwd = (*layer)->Forward(x, &saved, &out);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->out.raw(), out_bytes.data());
  EXPECT_EQ(fwd->out.bytes(), plain.fwd.out.bytes());

  Tensor d_x_bf16 = Tensor::Uninitialized(DType::kBFloat16, {24, c.hidden});
  EXPECT_EQ((*layer)->Backward(*saved, d_out, 1.0, 1.0, &d_x_bf16).status().code(),
            absl::StatusCode::kInvalidArgument);
  Tensor d_x = Tensor::View(DType::kFloat32, {24, c.hidden}, d_x_bytes.data());
  auto back = (*layer)->Backward(*saved, d_out, 1.0, 1.0, &d_x);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->raw(), d_x_bytes.data());
  EXPECT_EQ(back->bytes(), plain.d_x.bytes());
}

TEST(MoeLayerSmokeTest, Bf16AndEveryFeatureRuns) {
  LayerConfig c = Tiny();
  c.compute_dtype = DType::kBFloat16;
  c.score_function = ScoreFunction::kSigmoid;
  c.use_expert_bias = true;
  c.num_groups = 4;
  c.group_topk = 2;
  c.use_bias = true;
  c.align_size = 16;
  c.capacity_factor = 1.0;
  c.activation = Activation::kGelu;
  const Tensor x = Input(32, 32, 3).ConvertTo(DType::kBFloat16);
  const Tensor d_out = Input(32, 32, 4).ConvertTo(DType::kBFloat16);
  const Step a = RunStep(c, x, d_out), b = RunStep(c, x, d_out);
  EXPECT_EQ(a.fwd.out.dtype(), DType::kBFloat16);
  EXPECT_EQ(a.d_x.dtype(), DType::kBFloat16);
  EXPECT_TRUE(SameBytes(a.fwd.out, b.fwd.out));
  EXPECT_TRUE(SameBytes(a.d_x, b.d_x));
  ASSERT_EQ(a.grads.size(), 5u);  // gate, wi, wo, wi_bias, wo_bias
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(SameBytes(a.grads[i], b.grads[i]));
}

TEST(MoeLayerSmokeTest, ZeroTokens) {
  const LayerConfig c = Tiny();
  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(c, backend.get(), comm.get());
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::unique_ptr<StepContext> saved;
  auto fwd = (*layer)->Forward(Tensor::Zeros(DType::kFloat32, {0, 32}), &saved);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->out.shape(), (std::vector<int64_t>{0, 32}));
  EXPECT_EQ(fwd->aux_loss, 0.0);
  EXPECT_EQ(fwd->z_loss, 0.0);
  auto d_x = (*layer)->Backward(*saved, Tensor::Zeros(DType::kFloat32, {0, 32}), 1.0, 1.0);
  ASSERT_TRUE(d_x.ok()) << d_x.status();
  EXPECT_EQ(d_x->shape(), (std::vector<int64_t>{0, 32}));
  auto g = (*layer)->GetGradient("gate");
  ASSERT_TRUE(g.ok());
  for (int64_t i = 0; i < g->num_elements(); ++i) ASSERT_EQ(g->GetFloat(i), 0.0f);
}

TEST(MoeLayerSmokeTest, ContextUsedTwiceAndBadInputs) {
  const LayerConfig c = Tiny();
  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(c, backend.get(), comm.get());
  ASSERT_TRUE(layer.ok());
  std::unique_ptr<StepContext> saved;
  const Tensor x = Input(8, 32, 5);
  ASSERT_TRUE((*layer)->Forward(x, &saved).ok());
  EXPECT_EQ((*layer)->Backward(*saved, Input(9, 32, 6), 1, 1).status().code(),
            absl::StatusCode::kInvalidArgument);  // d_out shape differs from the forward's
  ASSERT_TRUE((*layer)->Backward(*saved, Input(8, 32, 6), 1, 1).ok());
  EXPECT_EQ((*layer)->Backward(*saved, Input(8, 32, 6), 1, 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*layer)->Forward(Input(8, 31, 5), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*layer)->Forward(Tensor::Zeros(DType::kInt32, {8, 32}), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*layer)->SetParameter("wi", Tensor::Zeros(DType::kFloat32, {8, 32, 64})).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*layer)->GetParameter("nope").status().code(), absl::StatusCode::kNotFound);
  LayerConfig bad = c;
  bad.top_k = 9;
  EXPECT_EQ(MoeLayer::Create(bad, backend.get(), comm.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MoeLayerSmokeTest, ParametersOptimizerAndState) {
  const LayerConfig c = Tiny();
  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(c, backend.get(), comm.get());
  ASSERT_TRUE(layer.ok());
  MoeLayer& l = **layer;
  EXPECT_EQ(l.ParameterNames(), (std::vector<std::string>{"gate", "wi", "wo"}));
  EXPECT_EQ(l.GetParameter("wi")->shape(), (std::vector<int64_t>{8, 32, 128}));
  EXPECT_EQ(l.GetParameter("wo")->shape(), (std::vector<int64_t>{8, 64, 32}));
  // SetParameter round trip.
  Tensor wo = *l.GetParameter("wo");
  wo.data<float>()[5] = 0.25f;
  ASSERT_TRUE(l.SetParameter("wo", wo).ok());
  EXPECT_EQ(l.GetParameter("wo")->GetFloat(5), 0.25f);
  EXPECT_TRUE(l.StateNames().empty());

  // SGD: p_new = p - lr * g, gradients zeroed afterwards.
  std::unique_ptr<StepContext> saved;
  ASSERT_TRUE(l.Forward(Input(16, 32, 7), &saved).ok());
  ASSERT_TRUE(l.Backward(*saved, Input(16, 32, 8), 1, 1).ok());
  const Tensor gate = *l.GetParameter("gate"), grad = *l.GetGradient("gate");
  ASSERT_TRUE(l.ApplyOptimizer(OptimizerConfig::Sgd(0.5)).ok());
  const Tensor gate2 = *l.GetParameter("gate");
  for (int64_t i = 0; i < gate.num_elements(); ++i) {
    ASSERT_FLOAT_EQ(gate2.GetFloat(i), gate.GetFloat(i) - 0.5f * grad.GetFloat(i));
  }
  for (int64_t i = 0; i < grad.num_elements(); ++i) ASSERT_EQ(l.GetGradient("gate")->GetFloat(i), 0);

  // AdamW creates m, v and the step count; SetState restores them.
  ASSERT_TRUE(l.ApplyOptimizer(OptimizerConfig::AdamW(1e-3, 0.01)).ok());
  EXPECT_EQ(l.StateNames(), (std::vector<std::string>{"gate.m", "gate.v", "wi.m", "wi.v", "wo.m",
                                                      "wo.v", "step"}));
  EXPECT_EQ(l.GetState("step")->GetFloat(0), 1.0f);
  ASSERT_TRUE(l.SetState("step", Tensor::FromFloats({1}, {4.0f})).ok());
  EXPECT_EQ(l.GetState("step")->GetFloat(0), 4.0f);
  EXPECT_EQ(l.SetState("wi.m", Tensor::Zeros(DType::kFloat32, {1})).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(l.SetState("bogus.m", Tensor::Zeros(DType::kFloat32, {1})).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(l.ApplyOptimizer(OptimizerConfig::Sgd(-1)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(l.UpdateExpertBias(0.1).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MoeLayerSmokeTest, ExpertBiasUpdateFollowsCounts) {
  LayerConfig c = Tiny();
  c.score_function = ScoreFunction::kSigmoid;
  c.use_expert_bias = true;
  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(c, backend.get(), comm.get());
  ASSERT_TRUE(layer.ok());
  auto fwd = (*layer)->Forward(Input(32, 32, 9), nullptr);
  ASSERT_TRUE(fwd.ok());
  const std::vector<int64_t> counts = (*layer)->accumulated_expert_counts();
  EXPECT_EQ(counts, fwd->tokens_per_expert);
  ASSERT_TRUE((*layer)->UpdateExpertBias(0.01).ok());
  const Tensor bias = *(*layer)->GetParameter("expert_bias");
  const double mean = 64.0 / 8.0;
  for (int e = 0; e < 8; ++e) {
    const float expect = counts[e] < mean ? 0.01f : (counts[e] > mean ? -0.01f : 0.0f);
    EXPECT_FLOAT_EQ(bias.GetFloat(e), expect) << e;
  }
  EXPECT_EQ((*layer)->accumulated_expert_counts(), std::vector<int64_t>(8, 0));
  EXPECT_EQ((*layer)->GetGradient("expert_bias").status().code(), absl::StatusCode::kNotFound);
}

TEST(MoeLayerSmokeTest, LocalCommunicatorRefusesDeviceMemory) {
  auto comm = MakeLocalCommunicator(MemorySpace::kDevice);
  EXPECT_EQ(comm->size(), 1);
  char a = 1, b = 0;
  EXPECT_EQ(comm->AllGather(&a, &b, 1).code(), absl::StatusCode::kFailedPrecondition);
  auto backend = MakeCpuBackend();
  EXPECT_EQ(MoeLayer::Create(Tiny(), backend.get(), comm.get()).status().code(),
            absl::StatusCode::kInvalidArgument);  // memory spaces differ
  auto host = MakeLocalCommunicator();
  const std::vector<size_t> two = {2}, three = {3};
  EXPECT_EQ(host->AllToAllV(&a, two, &b, three).code(), absl::StatusCode::kInvalidArgument);
}

TEST(MoeLayerSmokeTest, NanInputDoesNotCrash) {
  LayerConfig c = Tiny();
  c.capacity_factor = 1.0;
  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(c, backend.get(), comm.get());
  ASSERT_TRUE(layer.ok());
  Tensor x = Input(16, 32, 10);
  for (int64_t i = 0; i < 32 * 4; ++i) x.data<float>()[i] = std::nanf("");
  std::unique_ptr<StepContext> saved;
  auto fwd = (*layer)->Forward(x, &saved);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(std::isnan(fwd->out.GetFloat(0)));
  EXPECT_TRUE((*layer)->Backward(*saved, Input(16, 32, 11), 1, 1).ok());
}

// align_size = 2^62 with one routed pair made the padded row count wrap the int32 buffer size
// to 0 bytes and the permutation wrote 2^62 row indices into it (a crash); it is a config error.
TEST(MoeLayerSmokeTest, HugeAlignSizeIsAConfigErrorNotACrash) {
  LayerConfig c = Tiny();
  c.num_experts = 2;
  c.top_k = 1;
  c.align_size = int64_t{1} << 62;
  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(c, backend.get(), comm.get());
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kInvalidArgument) << layer.status();
  if (layer.ok()) {
    EXPECT_FALSE((*layer)->Forward(Input(1, 32, 12), nullptr).ok());
  }
}

// Optimizer state must be a floating tensor like a parameter; an INT32 tensor was converted to
// NaNs and accepted.
TEST(MoeLayerSmokeTest, SetStateRejectsNonFloatTensors) {
  auto backend = MakeCpuBackend();
  auto comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(Tiny(), backend.get(), comm.get());
  ASSERT_TRUE(layer.ok());
  MoeLayer& l = **layer;
  EXPECT_EQ(l.SetState("wi.m", Tensor::Zeros(DType::kInt32, {8, 32, 128})).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(l.SetState("step", Tensor::Zeros(DType::kInt64, {1})).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(l.StateNames().empty());
  // A step count beyond int64 was converted with undefined behaviour (a negative count, OK).
  EXPECT_EQ(l.SetState("step", Tensor::FromFloats({1}, {1e30f})).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(l.StateNames().empty());
  ASSERT_TRUE(l.SetState("wi.m", Tensor::Zeros(DType::kBFloat16, {8, 32, 128})).ok());
  EXPECT_EQ(l.StateNames(), (std::vector<std::string>{"wi.m"}));
}

}  // namespace
}  // namespace moe
