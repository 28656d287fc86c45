// Delayed FP8 scaling (docs/SPEC.md "FP8", "Delayed scaling") on the CPU backend, the exact
// emulation of the CUDA recipe: Backend::Fp8HistoryAmax and the quantisation with a given amax
// against naive double-precision references written here; the layer's history over steps
// (X's amax exactly), the scale coming from the earlier steps, the layer's FP8 output within
// SPEC's tolerance of the fp64 reference over several steps, the history in checkpoints (old
// checkpoints without it load) and emptied by SetParameter. Finite differences do not apply:
// an FP8 layer is piecewise constant in its inputs at the scale of one code.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/fp8.h"
#include "gtest/gtest.h"
#include "tests/engine/fp8_rounding.h"
#include "tests/engine/tiny_config.h"
#include "tests/reference/engine_adapter.h"
#include "tests/reference/finite_difference.h"
#include "tests/reference/reference_moe.h"

namespace moe_ref {
namespace {

using moe::DType;
using moe::LayerConfig;
using moe::Tensor;

constexpr double kFp8Out = 8e-2;  // docs/SPEC.md "FP8" Tolerances, out vs the fp64 reference

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// e4m3 by enumeration (not engine/fp8.h): the nearest of the 127 finite non-negative values
// (code c: exponent c >> 3, mantissa c & 7, bias 7, subnormals at exponent 0), ties to the even
// code, magnitudes past 448 saturate; the sign bit on top.
uint8_t NaiveE4M3(float v) {
  const double a = std::fabs(static_cast<double>(v));
  int best = 0;
  double best_diff = INFINITY;
  for (int c = 0; c <= 0x7e; ++c) {
    const int e = c >> 3, m = c & 7;
    const double value = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    const double diff = std::fabs(value - a);
    if (diff < best_diff || (diff == best_diff && c % 2 == 0)) best = c, best_diff = diff;
  }
  return static_cast<uint8_t>(best | (std::signbit(v) ? 0x80 : 0));
}

TEST(Fp8DelayedBackend, HistoryAmaxMatchesANaiveRing) {
  std::unique_ptr<moe::Backend> backend = moe::MakeCpuBackend(1);
  std::mt19937_64 rng(4001);
  for (int64_t len : {1, 3, 5}) {
    for (int margin : {0, 2}) {
      for (bool most_recent : {false, true}) {
        std::vector<float> history(len, 0.0f);
        std::deque<double> last;  // the reference: the last `len` amaxes, newest at the back
        for (int64_t step = 0; step < 11; ++step) {
          float amax = -1;
          moe::Fp8HistoryArgs h;
          h.history = history.data(), h.len = len, h.steps = step, h.margin = margin;
          h.most_recent = most_recent, h.amax = &amax;
          ASSERT_TRUE(backend->Fp8HistoryAmax(h).ok());
          double want = 0;
          if (!last.empty()) {
            want = most_recent ? last.back() : *std::max_element(last.begin(), last.end());
          }
          EXPECT_EQ(Bits(amax), Bits(static_cast<float>(want * std::pow(2.0, margin))))
              << "len " << len << " margin " << margin << " step " << step;
          EXPECT_EQ(history[step % len], 0.0f) << "this step's slot is zeroed";
          // This step's amax, as a quantisation kernel would reduce it into the slot.
          const float recorded = std::ldexp(static_cast<float>(1 + rng() % 1000) / 64.0f,
                                            static_cast<int>(rng() % 9) - 4);
          history[step % len] = recorded;
          last.push_back(recorded);
          if (static_cast<int64_t>(last.size()) > len) last.pop_front();
        }
      }
    }
  }
  moe::Fp8HistoryArgs bad;
  float out;
  bad.history = &out, bad.amax = &out, bad.len = 0;
  EXPECT_EQ(backend->Fp8HistoryAmax(bad).code(), absl::StatusCode::kInvalidArgument);
  bad.len = 1, bad.margin = 33;
  EXPECT_EQ(backend->Fp8HistoryAmax(bad).code(), absl::StatusCode::kInvalidArgument);
}

// The delayed scale (an amax smaller than this tensor's: its largest values saturate) and the
// amax of this step reduced while quantising.
TEST(Fp8DelayedBackend, QuantizeWithAGivenAmaxRecordsThisStepsAmax) {
  std::unique_ptr<moe::Backend> backend = moe::MakeCpuBackend(1);
  std::mt19937_64 rng(4002);
  std::normal_distribution<float> normal;
  const int64_t rows = 37, cols = 24;
  std::vector<float> src(rows * cols);
  for (float& v : src) v = normal(rng) * 3.0f;
  src[5] = NAN;  // ignored by the amax, NaN code
  const float given = 2.5f;
  float scale[4] = {};
  float amax_out = 0.5f;  // max() with what is already there
  std::vector<uint8_t> dst(rows * cols);
  moe::QuantizeArgs q;
  q.src = src.data(), q.src_type = DType::kFloat32, q.rows = rows, q.cols = cols;
  q.dst = dst.data(), q.scale = scale, q.amax = &given, q.amax_out = &amax_out;
  ASSERT_TRUE(backend->QuantizeFp8(q).ok());
  const float want_scale = static_cast<float>(static_cast<double>(given) / 448.0);
  EXPECT_EQ(Bits(scale[0]), Bits(want_scale));
  double want_amax = 0.5;
  int saturated = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (std::isnan(src[i])) {
      EXPECT_EQ(dst[i] & 0x7f, 0x7f) << i;
      continue;
    }
    want_amax = std::fmax(want_amax, std::fabs(src[i]));
    const float v = static_cast<float>(static_cast<double>(src[i]) / want_scale);
    EXPECT_EQ(dst[i], NaiveE4M3(v)) << i << ": " << src[i];
    saturated += std::fabs(v) > 448.0f;
  }
  EXPECT_GT(saturated, 10) << "the test wants saturated codes";
  EXPECT_EQ(Bits(amax_out), Bits(static_cast<float>(want_amax)));
}

LayerConfig DelayedConfig(int64_t len, moe::Fp8AmaxAlgo algo) {
  LayerConfig c = moe::TinyLayerConfig();
  c.init_seed = 17;
  c.compute_dtype = DType::kFloat8E4M3;
  c.fp8_recipe = moe::Fp8Recipe::kDelayed;
  c.fp8_amax_history_len = len;
  c.fp8_amax_compute_algo = algo;
  return c;
}

std::vector<float> StateFloats(const moe::MoeLayer& layer, const std::string& name) {
  absl::StatusOr<Tensor> t = layer.GetState(name);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return {};
  const Tensor f = t->ConvertTo(DType::kFloat32);
  const float* p = static_cast<const float*>(f.raw());
  return std::vector<float>(p, p + f.num_elements());
}

// Relative error of the layer's forward against the fp64 reference on its e4m3 weights.
double ForwardError(moe::MoeLayer* layer, const Tensor& x) {
  const LayerConfig& c = layer->config();
  RefParams p = ReadParams(*layer).value();
  p.wi = RoundExpertsToE4M3(p.wi, c.num_experts);
  p.wo = RoundExpertsToE4M3(p.wo, c.num_experts);
  absl::StatusOr<EngineStep> step = RunStep(layer, x, nullptr, 0, 0);
  EXPECT_TRUE(step.ok()) << step.status();
  if (!step.ok()) return INFINITY;
  const RefForwardResult ref = RefForward(FromLayerConfig(c), p, ToDoubles(x), x.dim(0));
  return RelativeError(ToDoubles(step->forward.out), ref.out);
}

Tensor Scaled(const std::vector<double>& base, double factor, int64_t hidden) {
  std::vector<double> v(base);
  for (double& d : v) d *= factor;
  return FromDoubles(v, {static_cast<int64_t>(base.size()) / hidden, hidden}, DType::kBFloat16);
}

// X's history slot of step i holds max |X| of step i (every token is dispatched, dropless),
// the ring wraps at len, and every tensor's count and slots follow.
TEST(Fp8DelayedLayer, HistoryRecordsEveryStepsAmaxInItsRing) {
  const LayerConfig c = DelayedConfig(2, moe::Fp8AmaxAlgo::kMax);
  absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(c);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::mt19937_64 rng(4003);
  // bf16-exact tokens; powers of two keep them exact, so step k's amax is factor_k * A.
  const Tensor base16 =
      FromDoubles(RandomNormal(40 * c.hidden, 1.0, &rng), {40, c.hidden}, DType::kBFloat16);
  const std::vector<double> base = ToDoubles(base16);
  double A = 0;
  for (double v : base) A = std::fmax(A, std::fabs(v));
  const double factors[] = {1.0, 4.0, 0.25};
  for (int step = 0; step < 3; ++step) {
    const Tensor x = Scaled(base, factors[step], c.hidden);
    const Tensor d_out =
        FromDoubles(RandomNormal(40 * c.hidden, 1.0, &rng), {40, c.hidden}, DType::kFloat32);
    ASSERT_TRUE(RunStep(cpu->layer.get(), x, &d_out, 0, 0).ok());
  }
  const std::vector<float> history = StateFloats(*cpu->layer, "fp8.amax_history");
  ASSERT_EQ(history.size(), 8u);  // [4 tensors, len 2]
  EXPECT_EQ(history[0], static_cast<float>(0.25 * A)) << "step 2 in slot 0 (ring wrapped)";
  EXPECT_EQ(history[1], static_cast<float>(4.0 * A)) << "step 1 in slot 1";
  for (int i = 2; i < 8; ++i) EXPECT_GT(history[i], 0.0f) << "a, d_y, d_h slot " << i;
  EXPECT_EQ(StateFloats(*cpu->layer, "fp8.amax_steps"), std::vector<float>(4, 3.0f));
}

// The scale of a step comes from the earlier steps: after small tokens, large ones saturate
// (most_recent, or a history of 1); two steps later every history has their magnitude and the
// layer is accurate again.
// Current scaling is accurate throughout. Steady inputs stay within SPEC's tolerance.
TEST(Fp8DelayedLayer, ScaleComesFromEarlierSteps) {
  for (bool delayed : {true, false}) {
    SCOPED_TRACE(delayed ? "delayed" : "current");
    LayerConfig c = DelayedConfig(1, moe::Fp8AmaxAlgo::kMostRecent);
    if (!delayed) {
      c.fp8_recipe = moe::Fp8Recipe::kCurrent;
      c.fp8_amax_history_len = moe::kDefaultFp8AmaxHistoryLen;
      c.fp8_amax_compute_algo = moe::Fp8AmaxAlgo::kMax;
    }
    absl::StatusOr<CpuLayer> cpu = MakeCpuLayer(c);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    std::mt19937_64 rng(4004);
    const std::vector<double> base = RandomNormal(48 * c.hidden, 1.0, &rng);
    EXPECT_LE(ForwardError(cpu->layer.get(), Scaled(base, 1.0 / 64, c.hidden)), kFp8Out);
    const double jump = ForwardError(cpu->layer.get(), Scaled(base, 1.0, c.hidden));
    if (delayed) {
      EXPECT_GT(jump, 0.3) << "X scaled from the small step's amax saturates";
    } else {
      EXPECT_LE(jump, kFp8Out);
    }
    // The saturated step recorded X's amax, but a's from its own saturated h: the next step's
    // a may still saturate; from the one after every tensor's history has its magnitude.
    for (int step = 0; step < 4; ++step) {
      const std::vector<double> fresh = RandomNormal(48 * c.hidden, 1.0, &rng);
      const double e = ForwardError(cpu->layer.get(), Scaled(fresh, 1.0, c.hidden));
      if (step > 0 || !delayed) EXPECT_LE(e, kFp8Out) << "step " << step;
      std::printf("%s steady step %d: out rel. error %.2e\n", delayed ? "delayed" : "current", step,
                  e);
    }
  }
}

std::string TempDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  return std::string(root != nullptr ? root : "/tmp") + "/" + name;
}

// A checkpoint holds the history: the loaded layer's next step is bitwise the saved layer's.
// Without the history file (a checkpoint of before) it loads with an empty history, and
// SetParameter empties it.
TEST(Fp8DelayedLayer, CheckpointsKeepTheHistoryAndSetParameterEmptiesIt) {
  const LayerConfig c = DelayedConfig(4, moe::Fp8AmaxAlgo::kMax);
  absl::StatusOr<CpuLayer> a = MakeCpuLayer(c), b = MakeCpuLayer(c), old = MakeCpuLayer(c);
  ASSERT_TRUE(a.ok() && b.ok() && old.ok());
  std::mt19937_64 rng(4005);
  for (int step = 0; step < 3; ++step) {
    const Tensor x =
        FromDoubles(RandomNormal(32 * c.hidden, 1.0 + step, &rng), {32, c.hidden}, DType::kFloat32);
    const Tensor d_out =
        FromDoubles(RandomNormal(32 * c.hidden, 1.0, &rng), {32, c.hidden}, DType::kFloat32);
    ASSERT_TRUE(RunStep(a->layer.get(), x, &d_out, 0, 0).ok());
  }
  const std::string dir = TempDir("fp8_delayed_ckpt");
  ASSERT_TRUE(moe::SaveCheckpoint(*a->layer, dir).ok());
  ASSERT_TRUE(moe::LoadCheckpoint(b->layer.get(), dir).ok());
  EXPECT_EQ(StateFloats(*b->layer, "fp8.amax_history"), StateFloats(*a->layer, "fp8.amax_history"));
  EXPECT_EQ(StateFloats(*b->layer, "fp8.amax_steps"), std::vector<float>(4, 3.0f));
  const Tensor x =
      FromDoubles(RandomNormal(32 * c.hidden, 0.5, &rng), {32, c.hidden}, DType::kFloat32);
  absl::StatusOr<EngineStep> sa = RunStep(a->layer.get(), x, nullptr, 0, 0);
  absl::StatusOr<EngineStep> sb = RunStep(b->layer.get(), x, nullptr, 0, 0);
  ASSERT_TRUE(sa.ok() && sb.ok());
  EXPECT_EQ(sa->forward.out.bytes(), sb->forward.out.bytes());

  ASSERT_EQ(std::remove((dir + "/fp8_rank_00000_of_00001.bin").c_str()), 0);
  ASSERT_TRUE(moe::LoadCheckpoint(old->layer.get(), dir).ok());
  EXPECT_EQ(StateFloats(*old->layer, "fp8.amax_steps"), std::vector<float>(4, 0.0f));

  ASSERT_TRUE(a->layer->SetParameter("wo", *a->layer->GetParameter("wo")).ok());
  EXPECT_EQ(StateFloats(*a->layer, "fp8.amax_steps"), std::vector<float>(4, 0.0f));
  EXPECT_EQ(StateFloats(*a->layer, "fp8.amax_history"), std::vector<float>(16, 0.0f));
  // Bad state is refused.
  EXPECT_EQ(a->layer->SetState("fp8.amax_steps", Tensor::FromFloats({4}, {1, 2, 8, 0})).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      a->layer->SetState("fp8.amax_history", Tensor::FromFloats({4, 4}, std::vector<float>(16, -1)))
          .code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ref
