#include "server/proto_convert.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/chunking.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

TEST(ProtoConvertTest, TensorRoundTripEveryDatatype) {
  for (DType dtype :
       {DType::kFloat32, DType::kBFloat16, DType::kFloat64, DType::kInt32, DType::kInt64}) {
    Tensor t = Tensor::Zeros(dtype, {2, 3});
    for (size_t i = 0; i < t.num_bytes(); ++i) static_cast<uint8_t*>(t.raw())[i] = i * 7 + 1;
    v1::Tensor proto;
    TensorToProto(t, &proto);
    EXPECT_EQ(proto.datatype(), DTypeName(dtype));
    absl::StatusOr<Tensor> back = TensorFromProto("x", proto);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype(), dtype);
    EXPECT_EQ(back->shape(), t.shape());
    EXPECT_EQ(back->bytes(), t.bytes());
  }
}

TEST(ProtoConvertTest, TensorErrorsNameTheField) {
  v1::Tensor proto;
  proto.add_shape(2);
  EXPECT_THAT(TensorFromProto("x", proto).status().message(), HasSubstr("x.datatype"));
  proto.set_datatype("FP16");
  absl::Status s = TensorFromProto("x", proto).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("FP16"));
  proto.set_datatype("FP32");
  proto.set_raw_data(std::string(7, '\0'));
  s = TensorFromProto("d_out", proto).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("d_out"));
  proto.clear_shape();
  proto.add_shape(-1);
  proto.set_raw_data("");
  EXPECT_EQ(TensorFromProto("x", proto).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ProtoConvertTest, ConfigDefaultsAndRoundTrip) {
  v1::LayerConfig proto;
  proto.set_hidden(16);
  proto.set_ffn(32);
  proto.set_num_experts(4);
  absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->top_k, 1);
  EXPECT_EQ(config->scaling_factor, 1.0);
  EXPECT_TRUE(config->gated);
  EXPECT_EQ(config->compute_dtype, DType::kFloat32);
  EXPECT_EQ(config->score_function, ScoreFunction::kSoftmax);
  EXPECT_EQ(config->activation, Activation::kSilu);

  proto.set_top_k(2);
  proto.set_gated(false);
  proto.set_scaling_factor(0.0);  // explicitly set zero is kept, not defaulted
  proto.set_score_function(v1::SCORE_FUNCTION_SIGMOID);
  proto.set_use_expert_bias(true);
  proto.set_activation(v1::ACTIVATION_GELU);
  proto.set_compute_dtype("BF16");
  proto.set_init_seed(99);
  config = ConfigFromProto(proto);
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->scaling_factor, 0.0);
  v1::LayerConfig again = ConfigToProto(*config);
  absl::StatusOr<LayerConfig> back = ConfigFromProto(again);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(ConfigToString(*back), ConfigToString(*config));
}

TEST(ProtoConvertTest, ConfigRejectsUnknownEnumsAndDtypes) {
  v1::LayerConfig proto;
  proto.set_compute_dtype("FP16");
  EXPECT_THAT(ConfigFromProto(proto).status().message(), HasSubstr("config.compute_dtype"));
  proto.set_compute_dtype("");
  proto.set_activation(static_cast<v1::Activation>(77));
  EXPECT_THAT(ConfigFromProto(proto).status().message(), HasSubstr("config.activation"));
}

TEST(ProtoConvertTest, OptimizerValidation) {
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

TEST(ProtoConvertTest, LayerNames) {
  EXPECT_TRUE(ValidateLayerName("name", "layer_0.mlp-1").ok());
  EXPECT_THAT(ValidateLayerName("name", "").message(), HasSubstr("name"));
  EXPECT_FALSE(ValidateLayerName("name", "a/b").ok());
  EXPECT_FALSE(ValidateLayerName("name", std::string(129, 'a')).ok());
}

TEST(ProtoConvertTest, LoadStatistics) {
  v1::ExpertLoad load = ComputeLoad({4, 0, 2, 0});
  EXPECT_EQ(load.min_tokens(), 0);
  EXPECT_EQ(load.max_tokens(), 4);
  EXPECT_DOUBLE_EQ(load.mean_tokens(), 1.5);
  EXPECT_THAT(load.idle_experts(), ::testing::ElementsAre(1, 3));
}

TEST(ChunkingTest, RoundTripWithSmallChunks) {
  Tensor t = Tensor::Zeros(DType::kFloat32, {5, 3});
  for (int i = 0; i < 15; ++i) t.data<float>()[i] = i * 0.5f;
  std::vector<v1::TensorChunk> chunks;
  ASSERT_TRUE(ChunkTensor("wi", t, 16, [&](const v1::TensorChunk& c) {
                chunks.push_back(c);
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(chunks.size(), 4u);  // 4 elements per chunk
  ChunkAssembler assembler({{"wi", ExpectedTensor{DType::kFloat32, {5, 3}}}});
  for (const auto& c : chunks) ASSERT_TRUE(assembler.Add(c).ok());
  auto tensors = assembler.Finish();
  ASSERT_TRUE(tensors.ok());
  ASSERT_EQ(tensors->size(), 1u);
  EXPECT_EQ((*tensors)[0].second.bytes(), t.bytes());
}

TEST(ChunkingTest, AssemblerRejectsBadStreams) {
  Tensor t = Tensor::Zeros(DType::kFloat32, {4});
  std::vector<v1::TensorChunk> chunks;
  ASSERT_TRUE(ChunkTensor("gate", t, 8, [&](const v1::TensorChunk& c) {
                chunks.push_back(c);
                return absl::OkStatus();
              }).ok());
  ASSERT_EQ(chunks.size(), 2u);
  {
    ChunkAssembler a({{"gate", ExpectedTensor{DType::kFloat32, {4}}}});
    EXPECT_THAT(a.Add(chunks[1]).message(), HasSubstr("element_offset"));  // out of order
  }
  {
    ChunkAssembler a({{"gate", ExpectedTensor{DType::kFloat32, {4}}}});
    ASSERT_TRUE(a.Add(chunks[0]).ok());
    EXPECT_THAT(a.Finish().status().message(), HasSubstr("incomplete"));
  }
  {
    ChunkAssembler a({{"gate", ExpectedTensor{DType::kFloat32, {5}}}});
    EXPECT_THAT(a.Add(chunks[0]).message(), HasSubstr("shape"));
  }
  {
    ChunkAssembler a({{"wo", ExpectedTensor{DType::kFloat32, {4}}}});
    EXPECT_THAT(a.Add(chunks[0]).message(), HasSubstr("unknown tensor name"));
  }
  {
    ChunkAssembler a({{"gate", ExpectedTensor{DType::kFloat32, {4}}}});
    ASSERT_TRUE(a.Add(chunks[0]).ok());
    ASSERT_TRUE(a.Add(chunks[1]).ok());
    EXPECT_THAT(a.Add(chunks[0]).message(), HasSubstr("already complete"));
  }
  {
    v1::TensorChunk odd = chunks[0];
    odd.set_raw_data(std::string(5, '\0'));
    ChunkAssembler a({{"gate", ExpectedTensor{DType::kFloat32, {4}}}});
    EXPECT_THAT(a.Add(odd).message(), HasSubstr("whole number"));
  }
}

}  // namespace
}  // namespace moe
