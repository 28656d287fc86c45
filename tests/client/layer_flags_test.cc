// moectl's layer flags (client/layer_flags.h): command lines parsed by absl into a
// moe.v1.LayerConfig, the defaults, the errors for unknown names, and the shared engine
// conversion (proto/config_convert.h) applied to the result.
#include "client/layer_flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "gtest/gtest.h"
#include "proto/config_convert.h"

namespace moe {
namespace client {
namespace {

// Parses `flags` as a command line; every test starts from the defaults.
class LayerFlagsTest : public ::testing::Test {
 protected:
  void Parse(std::vector<std::string> flags) {
    flags.insert(flags.begin(), "moectl");
    std::vector<char*> argv;
    for (std::string& f : flags) argv.push_back(f.data());
    absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
  }

 private:
  absl::FlagSaver saver_;
};

TEST_F(LayerFlagsTest, DefaultsAreTheTinySpecLayer) {
  auto config = LayerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden(), 32);
  EXPECT_EQ(config->ffn(), 64);
  EXPECT_EQ(config->num_experts(), 8);
  EXPECT_EQ(config->top_k(), 2);
  EXPECT_EQ(config->score_function(), v1::SCORE_FUNCTION_SOFTMAX);
  EXPECT_EQ(config->activation(), v1::ACTIVATION_SILU);
  EXPECT_TRUE(config->gated());
  EXPECT_EQ(config->compute_dtype(), "FP32");
}

TEST_F(LayerFlagsTest, EveryFlagReachesItsField) {
  Parse({"--hidden=1024", "--ffn=2048", "--experts=256", "--top_k=8", "--score_function=sigmoid",
         "--pre_softmax", "--num_groups=8", "--group_topk=4", "--scaling_factor=2.5",
         "--expert_bias", "--aux_loss_coeff=0.01", "--z_loss_coeff=0.001", "--capacity_factor=1.25",
         "--align_size=16", "--activation=GELU", "--gated=false", "--use_bias",
         "--compute_dtype=bf16", "--seed=1234567890123"});
  auto config = LayerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden(), 1024);
  EXPECT_EQ(config->ffn(), 2048);
  EXPECT_EQ(config->num_experts(), 256);
  EXPECT_EQ(config->top_k(), 8);
  EXPECT_EQ(config->score_function(), v1::SCORE_FUNCTION_SIGMOID);
  EXPECT_TRUE(config->pre_softmax());
  EXPECT_EQ(config->num_groups(), 8);
  EXPECT_EQ(config->group_topk(), 4);
  EXPECT_EQ(config->scaling_factor(), 2.5);
  EXPECT_TRUE(config->use_expert_bias());
  EXPECT_EQ(config->aux_loss_coeff(), 0.01);
  EXPECT_EQ(config->z_loss_coeff(), 0.001);
  EXPECT_EQ(config->capacity_factor(), 1.25);
  EXPECT_EQ(config->align_size(), 16);
  EXPECT_EQ(config->activation(), v1::ACTIVATION_GELU);
  EXPECT_TRUE(config->has_gated());
  EXPECT_FALSE(config->gated());
  EXPECT_TRUE(config->use_bias());
  EXPECT_EQ(config->compute_dtype(), "BF16");
  EXPECT_EQ(config->init_seed(), 1234567890123u);

  // And through the shared conversion to the engine's config.
  auto engine = ConfigFromProto(*config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(engine->num_experts, 256);
  EXPECT_EQ(engine->score_function, ScoreFunction::kSigmoid);
  EXPECT_EQ(engine->activation, Activation::kGelu);
  EXPECT_FALSE(engine->gated);
  EXPECT_EQ(engine->compute_dtype, DType::kBFloat16);
  EXPECT_EQ(engine->init_seed, 1234567890123u);
  EXPECT_EQ(ConfigToString(*engine), ConfigToString(*ConfigFromProto(ConfigToProto(*engine))));
}

TEST_F(LayerFlagsTest, Fp8ComputeDType) {
  absl::FlagSaver saver;
  Parse({"--compute_dtype=fp8"});
  auto config = LayerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->compute_dtype(), "FP8");
  auto engine = ConfigFromProto(*config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(engine->compute_dtype, DType::kFloat8E4M3);
  EXPECT_EQ(engine->fp8_recipe, Fp8Recipe::kDelayed);  // unset: the server's default
  EXPECT_NE(DescribeLayerConfig(*config).find("fp8_recipe=DELAYED"), std::string::npos);
}

TEST_F(LayerFlagsTest, Fp8Recipe) {
  absl::FlagSaver saver;
  Parse({"--compute_dtype=fp8", "--fp8_recipe=current"});
  auto config = LayerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->fp8_recipe(), "CURRENT");
  auto engine = ConfigFromProto(*config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(engine->fp8_recipe, Fp8Recipe::kCurrent);
  EXPECT_NE(DescribeLayerConfig(*config).find("fp8_recipe=CURRENT"), std::string::npos);
  Parse({"--fp8_recipe=late"});
  EXPECT_NE(LayerConfigFromFlags().status().message().find("--fp8_recipe"),
            absl::string_view::npos);
}

TEST_F(LayerFlagsTest, Fp8Gemms) {
  absl::FlagSaver saver;
  Parse({"--compute_dtype=fp8"});
  auto config = LayerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->fp8_gemms(), "");  // unset: the server's default
  EXPECT_NE(DescribeLayerConfig(*config).find("fp8_gemms=AUTO"), std::string::npos);
  Parse({"--compute_dtype=fp8", "--fp8_gemms=all"});
  config = LayerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->fp8_gemms(), "ALL");
  Parse({"--compute_dtype=fp8", "--fp8_gemms=FC1_FPROP,fc2_wgrad"});
  config = LayerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  auto engine = ConfigFromProto(*config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(Fp8GemmsPolicyName(engine->fp8_gemms), "fc1_fprop,fc2_wgrad");
  Parse({"--fp8_gemms=fc1"});
  EXPECT_NE(LayerConfigFromFlags().status().message().find("--fp8_gemms"),
            absl::string_view::npos);
}

TEST_F(LayerFlagsTest, DescribeLayerShowsTheFp8GemmsThatRan) {
  v1::LayerInfo info;
  info.set_name("l");
  info.mutable_config()->set_compute_dtype("FP8");
  info.set_fp8_gemms("fc1_fprop,fc1_dgrad,fc1_wgrad");
  EXPECT_NE(DescribeLayer(info).find("fp8_gemms: fc1_fprop,fc1_dgrad,fc1_wgrad"),
            std::string::npos);
  info.set_fp8_gemms("");
  EXPECT_EQ(DescribeLayer(info).find("fp8_gemms:"), std::string::npos);
}

TEST_F(LayerFlagsTest, UnknownNamesAreInvalidArgumentNamingTheFlag) {
  for (const char* flag : {"--score_function=tanh", "--activation=swish", "--compute_dtype=fp16"}) {
    absl::FlagSaver saver;
    Parse({flag});
    auto config = LayerConfigFromFlags();
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << flag;
    const std::string name = std::string(flag).substr(0, std::string(flag).find('='));
    EXPECT_NE(config.status().message().find(name), std::string::npos) << config.status();
  }
}

TEST_F(LayerFlagsTest, DescriptionNamesTheShape) {
  Parse({"--hidden=48", "--experts=4", "--aux_loss_coeff=0.5"});
  const std::string text = DescribeLayerConfig(*LayerConfigFromFlags());
  EXPECT_NE(text.find("hidden=48"), std::string::npos) << text;
  EXPECT_NE(text.find("experts=4"), std::string::npos) << text;
  EXPECT_NE(text.find("aux=0.5"), std::string::npos) << text;
  EXPECT_NE(text.find("activation=silu"), std::string::npos) << text;
}

// Unset optional fields are described with the defaults the server applies.
TEST_F(LayerFlagsTest, DescriptionOfUnsetFieldsShowsTheDefaults) {
  v1::LayerConfig config;
  config.set_hidden(8);
  config.set_ffn(16);
  config.set_num_experts(4);
  const std::string text = DescribeLayerConfig(config);
  EXPECT_NE(text.find("top_k=1 "), std::string::npos) << text;
  EXPECT_NE(text.find(" gated"), std::string::npos) << text;
  EXPECT_NE(text.find("compute=FP32"), std::string::npos) << text;
  EXPECT_EQ(text.find("scaling="), std::string::npos) << text;
  config.set_gated(false);
  config.set_scaling_factor(2);
  const std::string plain = DescribeLayerConfig(config);
  EXPECT_NE(plain.find(" plain"), std::string::npos) << plain;
  EXPECT_NE(plain.find("scaling=2"), std::string::npos) << plain;
}

// A config from a newer server may carry an activation this build has no name for: the
// description names its number instead of throwing.
TEST_F(LayerFlagsTest, DescriptionOfUnknownActivationDoesNotThrow) {
  Parse({});
  v1::LayerConfig config = *LayerConfigFromFlags();
  config.set_activation(static_cast<v1::Activation>(99));
  std::string text;
  EXPECT_NO_THROW(text = DescribeLayerConfig(config));
  EXPECT_NE(text.find("activation=unknown(99)"), std::string::npos) << text;
  config.set_activation(v1::ACTIVATION_GELU);
  text = DescribeLayerConfig(config);
  EXPECT_NE(text.find("activation=gelu"), std::string::npos) << text;
}

// The layer lines of `moectl status` / `list-layers` tell the operator what needs them.
TEST(DescribeLayerTest, SaysWhatNeedsTheOperator) {
  v1::LayerInfo layer;
  layer.set_name("l0");
  layer.set_ep_ranks(2);
  layer.set_forward_count(5);
  layer.mutable_config()->set_hidden(32);
  std::string text = DescribeLayer(layer);
  EXPECT_NE(text.find("  l0  "), std::string::npos) << text;
  EXPECT_NE(text.find("ep=2 forwards=5 saved_steps=0\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("weights reset"), std::string::npos) << text;
  EXPECT_EQ(text.find("DIVERGED"), std::string::npos) << text;
  layer.set_weights_reset(true);
  layer.set_diverged("ApplyOptimizer failed on some workers and may have taken effect on others");
  text = DescribeLayer(layer);
  EXPECT_NE(text.find("weights reset to init_seed after a worker was replaced: load a checkpoint"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("DIVERGED: ApplyOptimizer failed on some workers"), std::string::npos)
      << text;
  EXPECT_NE(text.find("LoadCheckpoint mends it"), std::string::npos) << text;
}

TEST(DescribeLayerTest, ShowsDurableStepAndLastCheckpoint) {
  v1::LayerInfo layer;
  layer.set_name("l0");
  EXPECT_EQ(DescribeLayer(layer).find("durable_step"), std::string::npos);  // no --state_dir
  layer.set_durable(true);
  layer.set_optimizer_step(7);
  layer.set_durable_optimizer_step(6);
  layer.set_durable_checkpoint_unix_ms(int64_t{1764547200000});  // 2025-12-01 00:00:00 UTC
  std::string text = DescribeLayer(layer);
  EXPECT_NE(text.find("optimizer_step=7 durable_step=6 last_checkpoint=2025-12-01T00:00:00Z"),
            std::string::npos)
      << text;
  layer.set_durable_checkpoint_unix_ms(0);
  layer.set_durable_error("disk full");
  text = DescribeLayer(layer);
  EXPECT_NE(text.find("last_checkpoint=none (init_seed)"), std::string::npos) << text;
  EXPECT_NE(text.find("DURABLE CHECKPOINT FAILED: disk full"), std::string::npos) << text;
}

}  // namespace
}  // namespace client
}  // namespace moe
