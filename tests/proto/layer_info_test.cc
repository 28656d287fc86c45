// Layer names, parameter layouts and expert load statistics (proto/layer_info.h).
#include "proto/layer_info.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(LayerInfoTest, LayerNames) {
  EXPECT_TRUE(ValidateLayerName("name", "layer_0.mlp-1").ok());
  EXPECT_THAT(ValidateLayerName("name", "").message(), HasSubstr("name"));
  EXPECT_FALSE(ValidateLayerName("name", "a/b").ok());
  EXPECT_TRUE(ValidateLayerName("name", std::string(128, 'a')).ok());
  EXPECT_EQ(ValidateLayerName("name", std::string(129, 'a')).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LayerInfoTest, ParametersInTheirFixedOrderWithWholeLayerShapes) {
  LayerConfig config;
  config.hidden = 8;
  config.ffn = 16;
  config.num_experts = 4;
  std::vector<std::string> names;
  for (const ParameterLayout& p : LayerParameters(config)) names.push_back(p.name);
  EXPECT_THAT(names, ElementsAre("gate", "wi", "wo"));
  const std::vector<ParameterLayout> gated = LayerParameters(config);
  EXPECT_THAT(gated[0].shape, ElementsAre(8, 4));
  EXPECT_FALSE(gated[0].expert_sharded);
  EXPECT_THAT(gated[1].shape, ElementsAre(4, 8, 32));  // gated: up = 2F
  EXPECT_TRUE(gated[1].expert_sharded);
  EXPECT_THAT(gated[2].shape, ElementsAre(4, 16, 8));

  config.gated = false;
  config.use_bias = true;
  config.score_function = ScoreFunction::kSigmoid;
  config.use_expert_bias = true;
  names.clear();
  const std::vector<ParameterLayout> all = LayerParameters(config);
  for (const ParameterLayout& p : all) names.push_back(p.name);
  EXPECT_THAT(names, ElementsAre("gate", "expert_bias", "wi", "wo", "wi_bias", "wo_bias"));
  EXPECT_FALSE(all[1].has_gradient);  // the expert bias is updated, not trained
  EXPECT_THAT(all[2].shape, ElementsAre(4, 8, 16));
  EXPECT_THAT(all[4].shape, ElementsAre(4, 16));
}

TEST(LayerInfoTest, LoadStatistics) {
  v1::ExpertLoad load = ComputeLoad({4, 0, 2, 0});
  EXPECT_EQ(load.min_tokens(), 0);
  EXPECT_EQ(load.max_tokens(), 4);
  EXPECT_DOUBLE_EQ(load.mean_tokens(), 1.5);
  EXPECT_THAT(load.tokens_per_expert(), ElementsAre(4, 0, 2, 0));
  EXPECT_THAT(load.idle_experts(), ElementsAre(1, 3));
  EXPECT_EQ(ComputeLoad({0, 0}).max_tokens(), 0);  // no tokens: no statistics
}

}  // namespace
}  // namespace moe
