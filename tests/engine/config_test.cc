#include "engine/config.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/tiny_config.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

LayerConfig Tiny() { return TinyLayerConfig(); }

void ExpectInvalid(const LayerConfig& c, int ranks, const std::string& field,
                   const std::string& rule_part) {
  absl::Status s = ValidateConfig(c, ranks);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field));
  EXPECT_THAT(std::string(s.message()), HasSubstr(rule_part));
}

TEST(ConfigTest, TinyIsValid) {
  EXPECT_TRUE(ValidateConfig(Tiny(), 1).ok());
  EXPECT_TRUE(ValidateConfig(Tiny(), 8).ok());
}

TEST(ConfigTest, SizesMustBePositive) {
  LayerConfig c = Tiny();
  c.hidden = 0;
  ExpectInvalid(c, 1, "hidden", "> 0");
  c = Tiny();
  c.ffn = -1;
  ExpectInvalid(c, 1, "ffn", "> 0");
  c = Tiny();
  c.num_experts = 0;
  ExpectInvalid(c, 1, "num_experts", "> 0");
  c = Tiny();
  c.top_k = 0;
  ExpectInvalid(c, 1, "top_k", "> 0");
  c = Tiny();
  c.top_k = 9;
  ExpectInvalid(c, 1, "top_k", "<= num_experts");
}

TEST(ConfigTest, ExpertsDivisibleByRanks) {
  ExpectInvalid(Tiny(), 3, "num_experts", "divisible by the number of EP ranks");
  EXPECT_FALSE(ValidateConfig(Tiny(), 0).ok());
}

TEST(ConfigTest, ExpertBiasOnlyWithSigmoid) {
  LayerConfig c = Tiny();
  c.use_expert_bias = true;
  ExpectInvalid(c, 1, "use_expert_bias", "sigmoid");
  c.score_function = ScoreFunction::kSigmoid;
  EXPECT_TRUE(ValidateConfig(c, 1).ok());
  c.pre_softmax = true;
  ExpectInvalid(c, 1, "pre_softmax", "softmax");
}

TEST(ConfigTest, GroupedTopKRules) {
  LayerConfig c = Tiny();
  c.num_experts = 256;
  c.top_k = 8;
  c.num_groups = 8;
  c.group_topk = 4;
  EXPECT_TRUE(ValidateConfig(c, 1).ok());
  LayerConfig bad = c;
  bad.group_topk = 0;
  ExpectInvalid(bad, 1, "group_topk", "both");
  bad = c;
  bad.num_groups = 7;
  ExpectInvalid(bad, 1, "num_groups", "divisible by num_groups");
  bad = c;
  bad.group_topk = 3;
  ExpectInvalid(bad, 1, "group_topk", "top_k (8) must be divisible");
  bad = c;
  bad.group_topk = 9;
  ExpectInvalid(bad, 1, "group_topk", "<= num_groups");
  bad = Tiny();  // E=8, 4 groups of 2, keep 1 group: at most 2 experts reachable
  bad.top_k = 3;
  bad.num_groups = 4;
  bad.group_topk = 1;
  ExpectInvalid(bad, 1, "top_k", "group_topk * num_experts / num_groups");
}

TEST(ConfigTest, NumericKnobs) {
  LayerConfig c = Tiny();
  c.capacity_factor = -0.5;
  ExpectInvalid(c, 1, "capacity_factor", ">= 0");
  c = Tiny();
  c.align_size = -1;
  ExpectInvalid(c, 1, "align_size", ">= 0");
  c = Tiny();
  c.aux_loss_coeff = -1;
  ExpectInvalid(c, 1, "aux_loss_coeff", ">= 0");
  c = Tiny();
  c.z_loss_coeff = std::numeric_limits<double>::quiet_NaN();
  ExpectInvalid(c, 1, "z_loss_coeff", "finite");
  c = Tiny();
  c.scaling_factor = 0;
  ExpectInvalid(c, 1, "scaling_factor", "> 0");
  c = Tiny();
  c.compute_dtype = DType::kFloat64;
  ExpectInvalid(c, 1, "compute_dtype", "FP32, BF16 or FP8");
  c.compute_dtype = DType::kFloat8E5M2;  // e5m2 is an operand format, not a compute dtype
  ExpectInvalid(c, 1, "compute_dtype", "FP32, BF16 or FP8");
  c.compute_dtype = DType::kFloat8E4M3;  // "FP8"
  EXPECT_TRUE(ValidateConfig(c, 1).ok());
}

TEST(ConfigTest, ComputeDTypeNames) {
  EXPECT_STREQ(ComputeDTypeName(DType::kFloat8E4M3), "FP8");
  EXPECT_STREQ(ComputeDTypeName(DType::kBFloat16), "BF16");
  EXPECT_EQ(*ParseComputeDType("FP8"), DType::kFloat8E4M3);
  EXPECT_EQ(*ParseComputeDType("FP32"), DType::kFloat32);
  EXPECT_FALSE(ParseComputeDType("FP8_E4M3").ok());
  EXPECT_FALSE(ParseComputeDType("FP64").ok());
  LayerConfig c = Tiny();
  c.compute_dtype = DType::kFloat8E4M3;
  EXPECT_NE(ConfigToString(c).find("compute_dtype=FP8 "), std::string::npos) << ConfigToString(c);
  absl::StatusOr<LayerConfig> back = ConfigFromString(ConfigToString(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->compute_dtype, DType::kFloat8E4M3);
  EXPECT_EQ(ExpertRowDType(c), DType::kBFloat16);
}

// An absurd align_size must be refused up front: rounding the per-expert row counts up to it
// would overflow int64 (and the row indices int32), and the forward wrote past its buffers.
TEST(ConfigTest, SizesHaveUpperBounds) {
  LayerConfig c = Tiny();
  c.hidden = kMaxHidden;
  c.ffn = kMaxFfn;
  c.num_experts = kMaxExperts;
  c.top_k = kMaxTopK;
  EXPECT_TRUE(ValidateConfig(c, 1).ok());  // validation allocates nothing
  c.hidden = kMaxHidden + 1;
  ExpectInvalid(c, 1, "hidden", "<= 65536");
  c.hidden = kMaxHidden;
  c.ffn = int64_t{1} << 62;
  ExpectInvalid(c, 1, "ffn", "<= 262144");
  c.ffn = kMaxFfn;
  c.num_experts = kMaxExperts + 1;
  c.top_k = 2;
  ExpectInvalid(c, 1, "num_experts", "<= 65536");
  c.num_experts = kMaxExperts;
  c.top_k = kMaxTopK + 1;
  ExpectInvalid(c, 1, "top_k", "<= 1024");
}

TEST(ConfigTest, AlignSizeHasAnUpperBound) {
  LayerConfig c = Tiny();
  c.align_size = 65536;
  EXPECT_TRUE(ValidateConfig(c, 1).ok());
  c.align_size = 65537;
  ExpectInvalid(c, 1, "align_size", "<= 65536");
  c.align_size = int64_t{1} << 62;
  ExpectInvalid(c, 1, "align_size", "<= 65536");
}

TEST(ConfigTest, StringRoundTripIsExact) {
  LayerConfig c = Tiny();
  c.score_function = ScoreFunction::kSigmoid;
  c.use_expert_bias = true;
  c.num_groups = 4;
  c.group_topk = 2;
  c.scaling_factor = 2.5 / 3.0;
  c.aux_loss_coeff = 1e-2;
  c.z_loss_coeff = 1.0 / 7.0;
  c.capacity_factor = 1.25;
  c.align_size = 16;
  c.activation = Activation::kGelu;
  c.gated = false;
  c.use_bias = true;
  c.compute_dtype = DType::kBFloat16;
  c.init_seed = 18446744073709551615ull;
  const std::string text = ConfigToString(c);
  absl::StatusOr<LayerConfig> back = ConfigFromString(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(ConfigToString(*back), text);
  EXPECT_EQ(back->scaling_factor, c.scaling_factor);
  EXPECT_EQ(back->z_loss_coeff, c.z_loss_coeff);
  EXPECT_EQ(back->init_seed, c.init_seed);
  EXPECT_EQ(back->activation, Activation::kGelu);
  EXPECT_EQ(back->compute_dtype, DType::kBFloat16);
  EXPECT_FALSE(back->gated);
}

TEST(ConfigTest, Fp8KnobsHaveTransformerEngineDefaultsAndRanges) {
  LayerConfig c = Tiny();
  EXPECT_EQ(c.fp8_recipe, Fp8Recipe::kDelayed);
  EXPECT_EQ(c.fp8_amax_history_len, 1024);
  EXPECT_EQ(c.fp8_margin, 0);
  EXPECT_EQ(c.fp8_amax_compute_algo, Fp8AmaxAlgo::kMax);
  c.compute_dtype = DType::kFloat8E4M3;
  c.fp8_recipe = Fp8Recipe::kCurrent;
  c.fp8_amax_history_len = 1;
  c.fp8_margin = 32;
  c.fp8_amax_compute_algo = Fp8AmaxAlgo::kMostRecent;
  EXPECT_TRUE(ValidateConfig(c, 1).ok());
  c.fp8_amax_history_len = 0;
  ExpectInvalid(c, 1, "fp8_amax_history_len", "[1, 65536]");
  c.fp8_amax_history_len = 65537;
  ExpectInvalid(c, 1, "fp8_amax_history_len", "[1, 65536]");
  c.fp8_amax_history_len = 16;
  c.fp8_margin = -1;
  ExpectInvalid(c, 1, "fp8_margin", "[0, 32]");
  c.fp8_margin = 33;
  ExpectInvalid(c, 1, "fp8_margin", "[0, 32]");
  // Ignored knobs are errors: away from their defaults they need compute_dtype FP8.
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    LayerConfig other = Tiny();
    other.compute_dtype = dtype;
    other.fp8_recipe = Fp8Recipe::kCurrent;
    ExpectInvalid(other, 1, "fp8_recipe", "only applies to compute_dtype=FP8");
    other = Tiny();
    other.compute_dtype = dtype;
    other.fp8_margin = 1;
    ExpectInvalid(other, 1, "fp8_margin", "only applies to compute_dtype=FP8");
  }
}

TEST(ConfigTest, Fp8KnobsRoundTripAndOldTextKeepsTheDefaults) {
  LayerConfig c = Tiny();
  c.compute_dtype = DType::kFloat8E4M3;
  c.fp8_recipe = Fp8Recipe::kCurrent;
  c.fp8_amax_history_len = 7;
  c.fp8_margin = 3;
  c.fp8_amax_compute_algo = Fp8AmaxAlgo::kMostRecent;
  absl::StatusOr<LayerConfig> back = ConfigFromString(ConfigToString(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->fp8_recipe, Fp8Recipe::kCurrent);
  EXPECT_EQ(back->fp8_amax_history_len, 7);
  EXPECT_EQ(back->fp8_margin, 3);
  EXPECT_EQ(back->fp8_amax_compute_algo, Fp8AmaxAlgo::kMostRecent);
  // A config written before the FP8 knobs existed (an old checkpoint's config.txt).
  absl::StatusOr<LayerConfig> old = ConfigFromString("hidden=32 ffn=64 compute_dtype=FP8");
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->fp8_recipe, Fp8Recipe::kDelayed);
  EXPECT_EQ(old->fp8_amax_history_len, kDefaultFp8AmaxHistoryLen);
  EXPECT_EQ(ConfigFromString("fp8_recipe=LATE").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConfigFromString("fp8_amax_compute_algo=mean").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ConfigTest, Fp8GemmsPolicyRoundTripsAndOnlyAppliesToFp8) {
  LayerConfig c = Tiny();
  EXPECT_EQ(c.fp8_gemms.kind, Fp8GemmsPolicy::Kind::kAuto);
  c.compute_dtype = DType::kFloat8E4M3;
  for (const char* text : {"AUTO", "ALL", "none", "fc1_fprop", "fc1_dgrad,fc2_wgrad",
                           "fc1_fprop,fc1_dgrad,fc1_wgrad,fc2_fprop,fc2_dgrad,fc2_wgrad"}) {
    SCOPED_TRACE(text);
    absl::StatusOr<Fp8GemmsPolicy> p = ParseFp8GemmsPolicy(text);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(Fp8GemmsPolicyName(*p), text);
    c.fp8_gemms = *p;
    EXPECT_TRUE(ValidateConfig(c, 1).ok());
    absl::StatusOr<LayerConfig> back = ConfigFromString(ConfigToString(c));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->fp8_gemms, *p);
  }
  // Names in another order come back in Fp8Gemm order.
  EXPECT_EQ(Fp8GemmsPolicyName(ParseFp8GemmsPolicy("fc2_wgrad,fc1_dgrad").value()),
            "fc1_dgrad,fc2_wgrad");
  for (const char* bad : {"", "auto", "fc3_fprop", "fc1_fprop,fc1_fprop", "fc1_fprop,"}) {
    EXPECT_EQ(ParseFp8GemmsPolicy(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  // Text written before the per-GEMM choice: AUTO.
  EXPECT_EQ(ConfigFromString("hidden=32 ffn=64 compute_dtype=FP8")->fp8_gemms, Fp8GemmsPolicy{});
  LayerConfig bf16 = Tiny();
  bf16.compute_dtype = DType::kBFloat16;
  bf16.fp8_gemms.kind = Fp8GemmsPolicy::Kind::kAll;
  ExpectInvalid(bf16, 1, "fp8_gemms", "only applies to compute_dtype=FP8");
}

TEST(ConfigTest, FromStringRejectsBadInput) {
  EXPECT_EQ(ConfigFromString("hidden=32 bogus=1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConfigFromString("hidden=abc").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConfigFromString("hidden=1 hidden=2").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConfigFromString("activation=swish").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConfigFromString("hidden").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ConfigTest, Names) {
  EXPECT_STREQ(ScoreFunctionName(ScoreFunction::kSigmoid), "sigmoid");
  EXPECT_STREQ(ActivationName(Activation::kRelu), "relu");
  EXPECT_EQ(*ParseActivation("linear"), Activation::kLinear);
  EXPECT_EQ(*ParseScoreFunction("softmax"), ScoreFunction::kSoftmax);
  EXPECT_FALSE(ParseScoreFunction("tanh").ok());
}

// The deferral budget: the fraction of a rank's wi + wo fp32 gradient bytes, none under FP8 or
// with a zero fraction; the variable parsed strictly.
TEST(ConfigTest, DeferredWgradBudget) {
  LayerConfig c = Tiny();
  c.gated = true;
  const int64_t gradient = 4 * c.num_experts * (c.hidden * 2 * c.ffn + c.ffn * c.hidden);
  EXPECT_EQ(DeferredWgradBudgetBytes(c, 1, 0.125), gradient / 8);
  EXPECT_EQ(DeferredWgradBudgetBytes(c, 2, 0.125), gradient / 16);
  EXPECT_EQ(DeferredWgradBudgetBytes(c, 1, 1.0), gradient);
  EXPECT_EQ(DeferredWgradBudgetBytes(c, 1, 0.0), 0);
  c.gated = false;
  EXPECT_EQ(DeferredWgradBudgetBytes(c, 1, 1.0), 4 * c.num_experts * 2 * c.ffn * c.hidden);
  c.compute_dtype = DType::kFloat8E4M3;
  EXPECT_EQ(DeferredWgradBudgetBytes(c, 1, 1.0), 0);

  for (double good : {kDefaultDeferredWgradFraction, 0.25, 0.0, 100.0}) {
    EXPECT_TRUE(CheckDeferredWgradFraction(good).ok()) << good;
  }
  for (double bad : {-0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    const absl::Status s = CheckDeferredWgradFraction(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.message()), HasSubstr("deferred_wgrad_fraction"));
  }
}

}  // namespace
}  // namespace moe
