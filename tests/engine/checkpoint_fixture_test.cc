// A checkpoint written by an earlier moed still loads (issue 38, "Must hold": the on-disk
// format that durable state and checkpoints use stays readable). The fixture
// tests/engine/testdata/checkpoint_2026_12/ was written by SaveCheckpoint on main at cf75445
// (a small layer trained two AdamW steps, expert bias and biases on: every file kind but
// FP8's), and is checked in; this test never rewrites it.
//
// Checked: VerifyCheckpoint accepts it, LoadCheckpoint loads it into a layer of another seed,
// and saving that layer again gives back every tensor of the fixture, bit for bit (so what was
// loaded is what was written: parameters, optimizer moments and step).
//
// To write a new fixture (only for a new format version, next to this one, never over it):
//   MOED_WRITE_CHECKPOINT_FIXTURE=$PWD/tests/engine/testdata/NAME \
//     bazel-bin/tests/engine/checkpoint_fixture_test --gtest_filter='*WriteFixture*'
#include <dirent.h>
#include <stdlib.h>

#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "engine/checkpoint_file.h"
#include "gtest/gtest.h"
#include "tests/reference/engine_adapter.h"

namespace moe {
namespace {

constexpr char kFixture[] = "tests/engine/testdata/checkpoint_2026_12";

LayerConfig FixtureConfig(uint64_t seed) {
  LayerConfig c;
  c.hidden = 8;
  c.ffn = 8;
  c.num_experts = 2;
  c.top_k = 1;
  c.score_function = ScoreFunction::kSigmoid;
  c.use_expert_bias = true;
  c.use_bias = true;
  c.aux_loss_coeff = 1e-2;
  c.init_seed = seed;
  return c;
}

std::string FixtureDir() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr) return kFixture;
  return std::string(srcdir) + "/" + (workspace != nullptr ? workspace : "moed") + "/" + kFixture;
}

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string templ = std::string(base != nullptr ? base : "/tmp") + "/ckpt.XXXXXX";
  EXPECT_NE(::mkdtemp(templ.data()), nullptr);
  return templ;
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

// A tensor file's tensors by name: dtype, shape and bytes.
std::map<std::string, std::string> TensorsOf(const std::string& path) {
  std::map<std::string, std::string> out;
  absl::StatusOr<std::vector<NamedTensor>> tensors = ReadTensorFile(path);
  EXPECT_TRUE(tensors.ok()) << path << ": " << tensors.status();
  if (!tensors.ok()) return out;
  for (const NamedTensor& t : *tensors) {
    std::string key = DTypeName(t.tensor.dtype());
    for (int64_t d : t.tensor.shape()) key += " " + std::to_string(d);
    out[t.name] = key + ":" + std::string(t.tensor.bytes());
  }
  return out;
}

void Train(MoeLayer* layer, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t H = layer->config().hidden;
  Tensor x = Tensor::Zeros(DType::kFloat32, {12, H});
  Tensor d = Tensor::Zeros(DType::kFloat32, {12, H});
  for (int64_t i = 0; i < x.num_elements(); ++i) x.data<float>()[i] = dist(rng);
  for (int64_t i = 0; i < d.num_elements(); ++i) d.data<float>()[i] = dist(rng);
  ASSERT_TRUE(moe_ref::RunStep(layer, x, &d, 1.0, 1.0).ok());
  ASSERT_TRUE(layer->ApplyOptimizer(OptimizerConfig::AdamW(1e-2)).ok());
  ASSERT_TRUE(layer->UpdateExpertBias(1e-3).ok());
}

// Not a check: writes a fixture where MOED_WRITE_CHECKPOINT_FIXTURE says (see the top).
TEST(CheckpointFixtureTest, WriteFixture) {
  const char* out = std::getenv("MOED_WRITE_CHECKPOINT_FIXTURE");
  if (out == nullptr) GTEST_SKIP() << "MOED_WRITE_CHECKPOINT_FIXTURE not set";
  absl::StatusOr<moe_ref::CpuLayer> layer = moe_ref::MakeCpuLayer(FixtureConfig(1));
  ASSERT_TRUE(layer.ok()) << layer.status();
  for (uint64_t s = 0; s < 2; ++s) Train(layer->layer.get(), s);
  ASSERT_TRUE(SaveCheckpoint(*layer->layer, out).ok());
}

TEST(CheckpointFixtureTest, CheckpointWrittenBeforeStillLoads) {
  const std::string fixture = FixtureDir();
  const std::vector<std::string> files = FilesIn(fixture);
  ASSERT_EQ(std::set<std::string>(files.begin(), files.end()),
            (std::set<std::string>{"COMPLETE", "config.txt", "router.bin", ExpertFileName(0),
                                   ExpertFileName(1)}))
      << fixture;
  ASSERT_TRUE(VerifyCheckpoint(FixtureConfig(7), fixture).ok());
  absl::StatusOr<moe_ref::CpuLayer> layer = moe_ref::MakeCpuLayer(FixtureConfig(7));
  ASSERT_TRUE(layer.ok()) << layer.status();
  const absl::Status loaded = LoadCheckpoint(layer->layer.get(), fixture);
  ASSERT_TRUE(loaded.ok()) << loaded;

  const std::string again = TempDir() + "/again";
  ASSERT_TRUE(SaveCheckpoint(*layer->layer, again).ok());
  for (const std::string& file : {std::string("router.bin"), ExpertFileName(0),
                                  ExpertFileName(1)}) {
    SCOPED_TRACE(file);
    const auto expected = TensorsOf(fixture + "/" + file);
    ASSERT_FALSE(expected.empty());
    EXPECT_EQ(TensorsOf(again + "/" + file), expected);
  }
  EXPECT_TRUE(TensorsOf(fixture + "/router.bin").count("step") == 1);
}

}  // namespace
}  // namespace moe
