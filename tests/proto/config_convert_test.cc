// moe.v1.LayerConfig and the optimizer messages <-> the engine's configs
// (proto/config_convert.h): the documented defaults, round trips, and the errors.
#include "proto/config_convert.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

v1::LayerConfig Shape() {
  v1::LayerConfig proto;  // nothing optional set
  proto.set_hidden(16);
  proto.set_ffn(32);
  proto.set_num_experts(4);
  return proto;
}

TEST(ConfigConvertTest, UnsetFieldsTakeTheProtoDefaults) {
  absl::StatusOr<LayerConfig> config = ConfigFromProto(Shape());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden, 16);
  EXPECT_EQ(config->ffn, 32);
  EXPECT_EQ(config->num_experts, 4);
  // proto/moe.proto: top_k 1, scaling 1.0, gated, softmax, silu, FP32.
  EXPECT_EQ(config->top_k, 1);
  EXPECT_EQ(config->scaling_factor, 1.0);
  EXPECT_TRUE(config->gated);
  EXPECT_EQ(config->compute_dtype, DType::kFloat32);
  EXPECT_EQ(config->score_function, ScoreFunction::kSoftmax);
  EXPECT_EQ(config->activation, Activation::kSilu);
  EXPECT_FALSE(config->use_bias);
  EXPECT_EQ(config->capacity_factor, 0.0);
}

TEST(ConfigConvertTest, SetFieldsAreKeptAndRoundTrip) {
  v1::LayerConfig proto = Shape();
  proto.set_top_k(2);
  proto.set_gated(false);
  proto.set_scaling_factor(0.0);  // explicitly set zero is kept, not defaulted
  proto.set_score_function(v1::SCORE_FUNCTION_SIGMOID);
  proto.set_use_expert_bias(true);
  proto.set_activation(v1::ACTIVATION_GELU);
  proto.set_compute_dtype("BF16");
  proto.set_init_seed(1234567890123u);
  absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->top_k, 2);
  EXPECT_FALSE(config->gated);
  EXPECT_EQ(config->scaling_factor, 0.0);
  EXPECT_EQ(config->score_function, ScoreFunction::kSigmoid);
  EXPECT_EQ(config->activation, Activation::kGelu);
  EXPECT_EQ(config->compute_dtype, DType::kBFloat16);
  EXPECT_EQ(config->init_seed, 1234567890123u);

  const v1::LayerConfig again = ConfigToProto(*config);
  EXPECT_TRUE(again.has_top_k());  // every field set: the config as applied
  EXPECT_TRUE(again.has_scaling_factor());
  EXPECT_TRUE(again.has_gated());
  EXPECT_EQ(again.compute_dtype(), "BF16");
  absl::StatusOr<LayerConfig> back = ConfigFromProto(again);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(ConfigToString(*back), ConfigToString(*config));
}

TEST(ConfigConvertTest, Fp8ComputeDTypeRoundTrips) {
  v1::LayerConfig proto = Shape();
  proto.set_compute_dtype("FP8");
  absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->compute_dtype, DType::kFloat8E4M3);
  EXPECT_EQ(ConfigToProto(*config).compute_dtype(), "FP8");
  proto.set_compute_dtype("FP8_E5M2");  // operand formats are not compute dtypes
  EXPECT_THAT(ConfigFromProto(proto).status().message(), HasSubstr("config.compute_dtype"));
}

TEST(ConfigConvertTest, Fp8RecipeFieldsDefaultAndRoundTrip) {
  v1::LayerConfig proto = Shape();
  proto.set_compute_dtype("FP8");
  absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->fp8_recipe, Fp8Recipe::kDelayed);  // proto/moe.proto: empty = DELAYED
  EXPECT_EQ(config->fp8_amax_history_len, 1024);
  EXPECT_EQ(config->fp8_margin, 0);
  EXPECT_EQ(config->fp8_amax_compute_algo, Fp8AmaxAlgo::kMax);
  proto.set_fp8_recipe("CURRENT");
  proto.set_fp8_amax_history_len(16);
  proto.set_fp8_margin(2);
  proto.set_fp8_amax_compute_algo("most_recent");
  config = ConfigFromProto(proto);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->fp8_recipe, Fp8Recipe::kCurrent);
  EXPECT_EQ(config->fp8_amax_history_len, 16);
  EXPECT_EQ(config->fp8_margin, 2);
  EXPECT_EQ(config->fp8_amax_compute_algo, Fp8AmaxAlgo::kMostRecent);
  const v1::LayerConfig again = ConfigToProto(*config);
  EXPECT_EQ(again.fp8_recipe(), "CURRENT");
  EXPECT_EQ(again.fp8_amax_compute_algo(), "most_recent");
  EXPECT_EQ(ConfigToString(*ConfigFromProto(again)), ConfigToString(*config));
  proto.set_fp8_recipe("delayed");  // case-sensitive, as compute_dtype
  EXPECT_THAT(ConfigFromProto(proto).status().message(), HasSubstr("config.fp8_recipe"));
  proto.set_fp8_recipe("");
  proto.set_fp8_amax_compute_algo("mean");
  EXPECT_THAT(ConfigFromProto(proto).status().message(), HasSubstr("config.fp8_amax_compute_algo"));
}

TEST(ConfigConvertTest, Fp8GemmsDefaultsToAutoAndRoundTrips) {
  v1::LayerConfig proto = Shape();
  proto.set_compute_dtype("FP8");
  absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->fp8_gemms.kind, Fp8GemmsPolicy::Kind::kAuto);  // empty = AUTO
  EXPECT_EQ(ConfigToProto(*config).fp8_gemms(), "AUTO");
  proto.set_fp8_gemms("fc2_dgrad,fc1_fprop");
  config = ConfigFromProto(proto);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->fp8_gemms.kind, Fp8GemmsPolicy::Kind::kSet);
  EXPECT_EQ(ConfigToProto(*config).fp8_gemms(), "fc1_fprop,fc2_dgrad");
  proto.set_fp8_gemms("fc1");
  EXPECT_THAT(ConfigFromProto(proto).status().message(), HasSubstr("config.fp8_gemms"));
  proto.set_compute_dtype("BF16");
  proto.set_fp8_gemms("ALL");  // converted; ValidateConfig refuses it for BF16
  ASSERT_TRUE(ConfigFromProto(proto).ok());
  EXPECT_THAT(ValidateConfig(*ConfigFromProto(proto), 1).message(), HasSubstr("fp8_gemms"));
}

TEST(ConfigConvertTest, EveryActivationRoundTrips) {
  for (v1::Activation activation :
       {v1::ACTIVATION_SILU, v1::ACTIVATION_GELU, v1::ACTIVATION_RELU, v1::ACTIVATION_LINEAR}) {
    v1::LayerConfig proto = Shape();
    proto.set_activation(activation);
    absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(ConfigToProto(*config).activation(), activation);
  }
}

TEST(ConfigConvertTest, UnknownEnumsAndDtypesAreInvalidArgumentNamingTheField) {
  v1::LayerConfig proto = Shape();
  proto.set_compute_dtype("FP16");
  absl::Status s = ConfigFromProto(proto).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("config.compute_dtype"));
  proto.set_compute_dtype("");
  proto.set_activation(static_cast<v1::Activation>(77));
  EXPECT_THAT(ConfigFromProto(proto).status().message(), HasSubstr("config.activation"));
  proto.set_activation(v1::ACTIVATION_UNSPECIFIED);
  proto.set_score_function(static_cast<v1::ScoreFunction>(9));
  EXPECT_THAT(ConfigFromProto(proto).status().message(), HasSubstr("config.score_function"));
}

TEST(ConfigConvertTest, OptimizerValidation) {
  EXPECT_THAT(OptimizerFromProto(nullptr, nullptr).status().message(), HasSubstr("optimizer"));
  v1::SgdOptimizer sgd;
  EXPECT_THAT(OptimizerFromProto(&sgd, nullptr).status().message(), HasSubstr("sgd.lr"));
  sgd.set_lr(0.1);
  sgd.set_momentum(1.5);
  EXPECT_THAT(OptimizerFromProto(&sgd, nullptr).status().message(), HasSubstr("sgd.momentum"));
  v1::AdamWOptimizer adamw;
  adamw.set_lr(1e-3);
  absl::StatusOr<OptimizerConfig> o = OptimizerFromProto(nullptr, &adamw);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->kind, OptimizerConfig::Kind::kAdamW);
  EXPECT_DOUBLE_EQ(o->beta1, 0.9);
  EXPECT_DOUBLE_EQ(o->beta2, 0.999);
  adamw.set_eps(0);
  EXPECT_THAT(OptimizerFromProto(nullptr, &adamw).status().message(), HasSubstr("adamw.eps"));
}

}  // namespace
}  // namespace moe
