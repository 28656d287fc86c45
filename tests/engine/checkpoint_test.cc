// Layer checkpoints (engine/checkpoint.h): exact round trip into a layer of another seed,
// optimizer state included; every kind of damage (corrupted byte, truncation, missing file,
// missing COMPLETE, config mismatch) is rejected with the right code and leaves the layer
// exactly as it was; and a checkpoint saved at EP = 2 loads at EP = 1 and back.
#include "engine/checkpoint.h"

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/checkpoint_file.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/comm/memory_kv_store.h"
#include "engine/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "tests/reference/engine_adapter.h"

namespace moe {
namespace {

using moe_ref::CpuLayer;
using moe_ref::MakeCpuLayer;

LayerConfig TestConfig(uint64_t seed) {
  LayerConfig c;
  c.hidden = 16;
  c.ffn = 24;
  c.num_experts = 8;
  c.top_k = 2;
  c.score_function = ScoreFunction::kSigmoid;
  c.use_expert_bias = true;
  c.use_bias = true;
  c.aux_loss_coeff = 1e-2;
  c.init_seed = seed;
  return c;
}

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string templ = std::string(base != nullptr ? base : "/tmp") + "/ckpt.XXXXXX";
  EXPECT_NE(::mkdtemp(templ.data()), nullptr);
  return templ;
}

Tensor RandomInput(int64_t tokens, int64_t hidden, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tensor t = Tensor::Zeros(DType::kFloat32, {tokens, hidden});
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = dist(rng);
  return t;
}

// One training step: forward/backward on seeded data, optimizer, expert-bias update.
void TrainStep(MoeLayer* layer, uint64_t seed, const OptimizerConfig& opt) {
  const int64_t H = layer->config().hidden;
  Tensor x = RandomInput(24, H, seed), d = RandomInput(24, H, seed + 1000);
  ASSERT_TRUE(moe_ref::RunStep(layer, x, &d, 1.0, 1.0).ok());
  ASSERT_TRUE(layer->ApplyOptimizer(opt).ok());
  ASSERT_TRUE(layer->UpdateExpertBias(1e-3).ok());
}

// Every parameter and optimizer state of a layer, as bytes.
std::map<std::string, std::string> Snapshot(const MoeLayer& layer) {
  std::map<std::string, std::string> out;
  for (const std::string& name : layer.ParameterNames()) {
    out[name] = std::string(layer.GetParameter(name).value().bytes());
  }
  for (const std::string& name : layer.StateNames()) {
    out["state:" + name] = std::string(layer.GetState(name).value().bytes());
  }
  return out;
}

std::string ForwardBytes(MoeLayer* layer) {
  absl::StatusOr<ForwardResult> r =
      layer->Forward(RandomInput(20, layer->config().hidden, 77), nullptr);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::string(r->out.bytes()) : "";
}

void WriteRaw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir() + "/layer0";
    absl::StatusOr<CpuLayer> saved = MakeCpuLayer(TestConfig(1));
    ASSERT_TRUE(saved.ok()) << saved.status();
    saved_ = std::move(*saved);
    for (int s = 0; s < 2; ++s) TrainStep(saved_.layer.get(), s, OptimizerConfig::AdamW(1e-2));
    ASSERT_TRUE(SaveCheckpoint(*saved_.layer, dir_).ok());
    absl::StatusOr<CpuLayer> fresh = MakeCpuLayer(TestConfig(2));
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    fresh_ = std::move(*fresh);
  }

  // Loading must fail with `code`, name `file` in the message, and leave fresh_ untouched.
  void ExpectRejected(absl::StatusCode code, const std::string& file) {
    const auto before = Snapshot(*fresh_.layer);
    absl::Status s = LoadCheckpoint(fresh_.layer.get(), dir_);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(file), std::string::npos) << s;
    EXPECT_EQ(Snapshot(*fresh_.layer), before) << "a failed load changed the layer";
    // moed's check of its durable state at start: the same verdict without a layer.
    absl::Status verified = VerifyCheckpoint(fresh_.layer->config(), dir_);
    EXPECT_EQ(verified.code(), code) << verified;
    EXPECT_NE(verified.message().find(file), std::string::npos) << verified;
  }

  std::string dir_;
  CpuLayer saved_, fresh_;
};

TEST_F(CheckpointTest, RoundTripIsExactIncludingOptimizerState) {
  const auto expected = Snapshot(*saved_.layer);
  ASSERT_NE(Snapshot(*fresh_.layer), expected);
  ASSERT_TRUE(expected.count("state:step") && expected.count("state:wi.v"));
  ASSERT_TRUE(LoadCheckpoint(fresh_.layer.get(), dir_).ok());
  EXPECT_EQ(Snapshot(*fresh_.layer), expected);
  EXPECT_EQ(ForwardBytes(fresh_.layer.get()), ForwardBytes(saved_.layer.get()));
  // Training continues identically: moments and the AdamW step count came back too.
  TrainStep(saved_.layer.get(), 9, OptimizerConfig::AdamW(1e-2));
  TrainStep(fresh_.layer.get(), 9, OptimizerConfig::AdamW(1e-2));
  EXPECT_EQ(Snapshot(*fresh_.layer), Snapshot(*saved_.layer));
}

// compute_dtype and init_seed are not part of what a checkpoint must match: fp32-trained
// masters load into a bf16-compute layer, whose compute copies then follow the loaded masters
// (it computes what a bf16 layer given those masters by SetParameter computes).
TEST_F(CheckpointTest, LoadsIntoAnotherComputeDtypeAndRefreshesComputeCopies) {
  LayerConfig bf16 = TestConfig(6);
  bf16.compute_dtype = DType::kBFloat16;
  absl::StatusOr<CpuLayer> loaded = MakeCpuLayer(bf16);
  absl::StatusOr<CpuLayer> set = MakeCpuLayer(bf16);
  ASSERT_TRUE(loaded.ok() && set.ok());
  ASSERT_TRUE(LoadCheckpoint(loaded->layer.get(), dir_).ok());
  for (const std::string& name : saved_.layer->ParameterNames()) {
    ASSERT_TRUE(set->layer->SetParameter(name, saved_.layer->GetParameter(name).value()).ok());
  }
  const std::string out = ForwardBytes(loaded->layer.get());
  EXPECT_EQ(out, ForwardBytes(set->layer.get()));
  EXPECT_NE(out, ForwardBytes(saved_.layer.get()));  // bf16 really is in use
}

TEST_F(CheckpointTest, StateTheCheckpointLacksIsReset) {
  // A layer with SGD momentum saved; a layer with AdamW state loads it: v and step go.
  absl::StatusOr<CpuLayer> sgd = MakeCpuLayer(TestConfig(3));
  ASSERT_TRUE(sgd.ok());
  TrainStep(sgd->layer.get(), 5, OptimizerConfig::Sgd(1e-2, 0.9));
  const std::string sgd_dir = TempDir() + "/sgd";
  ASSERT_TRUE(SaveCheckpoint(*sgd->layer, sgd_dir).ok());
  ASSERT_TRUE(LoadCheckpoint(saved_.layer.get(), sgd_dir).ok());
  for (const std::string& name : saved_.layer->StateNames()) {
    Tensor got = saved_.layer->GetState(name).value();
    if (name.size() > 2 && name.substr(name.size() - 2) == ".m") {
      EXPECT_EQ(got.bytes(), sgd->layer->GetState(name).value().bytes()) << name;
    } else {
      for (int64_t i = 0; i < got.num_elements(); ++i) ASSERT_EQ(got.GetFloat(i), 0.0f) << name;
    }
  }
  TrainStep(sgd->layer.get(), 6, OptimizerConfig::Sgd(1e-2, 0.9));
  TrainStep(saved_.layer.get(), 6, OptimizerConfig::Sgd(1e-2, 0.9));
  for (const std::string& name : sgd->layer->ParameterNames()) {
    EXPECT_EQ(saved_.layer->GetParameter(name).value().bytes(),
              sgd->layer->GetParameter(name).value().bytes())
        << name;
  }
}

TEST_F(CheckpointTest, VerifyAcceptsAnIntactCheckpoint) {
  EXPECT_TRUE(VerifyCheckpoint(fresh_.layer->config(), dir_).ok());
}

TEST_F(CheckpointTest, CorruptedByteIsDataLossAndChangesNothing) {
  const std::string path = dir_ + "/" + ExpertFileName(3);
  std::string bytes = ReadWholeFile(path).value();
  bytes[bytes.size() / 2] ^= 0x01;
  WriteRaw(path, bytes);
  ExpectRejected(absl::StatusCode::kDataLoss, ExpertFileName(3));
}

TEST_F(CheckpointTest, TruncatedFileIsDataLossAndChangesNothing) {
  const std::string path = dir_ + "/router.bin";
  std::string bytes = ReadWholeFile(path).value();
  WriteRaw(path, bytes.substr(0, bytes.size() - 5));
  ExpectRejected(absl::StatusCode::kDataLoss, "router.bin");
}

TEST_F(CheckpointTest, MissingFilesAreRejected) {
  ASSERT_EQ(::unlink((dir_ + "/" + ExpertFileName(7)).c_str()), 0);
  ExpectRejected(absl::StatusCode::kNotFound, ExpertFileName(7));
  ASSERT_EQ(::unlink((dir_ + "/COMPLETE").c_str()), 0);
  ExpectRejected(absl::StatusCode::kDataLoss, "COMPLETE");
  dir_ += "/absent";
  ExpectRejected(absl::StatusCode::kNotFound, "absent");
}

TEST_F(CheckpointTest, ConfigMismatchIsFailedPrecondition) {
  LayerConfig other = TestConfig(2);
  other.ffn = 32;
  absl::StatusOr<CpuLayer> layer = MakeCpuLayer(other);
  ASSERT_TRUE(layer.ok());
  // The old layer first: CpuLayer's move assignment replaces the backend before the layer, whose
  // buffers are freed through it (a use after free under ASan).
  fresh_.layer.reset();
  fresh_ = std::move(*layer);
  ExpectRejected(absl::StatusCode::kFailedPrecondition, "ffn");
}

TEST_F(CheckpointTest, DamagedConfigIsDataLoss) {
  WriteRaw(dir_ + "/config.txt", "hidden=16 ffn=banana\n");
  ExpectRejected(absl::StatusCode::kDataLoss, "config.txt");
}

TEST_F(CheckpointTest, TensorThatDoesNotFitTheConfigIsDataLoss) {
  // A well-formed file with the wrong shape for this config.
  const std::string path = dir_ + "/" + ExpertFileName(2);
  std::vector<NamedTensor> tensors = ReadTensorFile(path).value();
  tensors[0].tensor = Tensor::Zeros(DType::kFloat32, {3, 3});
  ASSERT_TRUE(WriteTensorFile(path, tensors).ok());
  ExpectRejected(absl::StatusCode::kDataLoss, ExpertFileName(2));
}

TEST_F(CheckpointTest, SavingAgainReplacesTheCheckpoint) {
  TrainStep(saved_.layer.get(), 3, OptimizerConfig::AdamW(1e-2));
  ASSERT_TRUE(SaveCheckpoint(*saved_.layer, dir_).ok());
  ASSERT_TRUE(LoadCheckpoint(fresh_.layer.get(), dir_).ok());
  EXPECT_EQ(Snapshot(*fresh_.layer), Snapshot(*saved_.layer));
  // Exactly the files of the format, no temporaries left behind.
  std::vector<std::string> names;
  DIR* d = ::opendir(dir_.c_str());
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') names.push_back(e->d_name);
  }
  ::closedir(d);
  EXPECT_EQ(names.size(), 3u + 8u);
  for (const std::string& n : names) EXPECT_EQ(n.find(".tmp"), std::string::npos) << n;
}

// Runs fn(rank, layer) for an EP group of `size` layers on threads (Gloo over loopback).
void RunEp(int size, const LayerConfig& config, const std::function<void(int, MoeLayer*)>& fn) {
  auto store = std::make_shared<MemoryKeyValueStore>();
  static int group = 0;
  const std::string prefix = "ckpt" + std::to_string(group++);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      CommOptions options;
      options.timeout = absl::Seconds(20);
      auto comm = MakeGlooCommunicator(store, prefix, r, size, options, {"", "127.0.0.1"});
      ASSERT_TRUE(comm.ok()) << comm.status();
      std::unique_ptr<Backend> backend = MakeCpuBackend(1);
      auto layer = MoeLayer::Create(config, backend.get(), comm->get());
      ASSERT_TRUE(layer.ok()) << layer.status();
      fn(r, layer->get());
    });
  }
  for (auto& t : threads) t.join();
}

// Experts, not ranks: EP = 1 -> EP = 2 -> EP = 1 gives back the same layer.
TEST(CheckpointEpTest, LoadsAtAnotherExpertParallelSize) {
  const std::string dir1 = TempDir() + "/ep1", dir2 = TempDir() + "/ep2";
  absl::StatusOr<CpuLayer> one = MakeCpuLayer(TestConfig(1));
  ASSERT_TRUE(one.ok());
  TrainStep(one->layer.get(), 0, OptimizerConfig::AdamW(1e-2));
  ASSERT_TRUE(SaveCheckpoint(*one->layer, dir1).ok());
  const auto expected = Snapshot(*one->layer);

  RunEp(2, TestConfig(4), [&](int rank, MoeLayer* layer) {
    ASSERT_TRUE(LoadCheckpoint(layer, dir1).ok());
    // This rank's experts are rows [rank*4, rank*4+4) of the EP=1 tensors.
    const Tensor wi = layer->GetParameter("wi").value();
    const Tensor all = one->layer->GetParameter("wi").value();
    EXPECT_EQ(wi.bytes(), all.bytes().substr(rank * wi.num_bytes(), wi.num_bytes()));
    ASSERT_TRUE(SaveCheckpoint(*layer, dir2).ok());
  });

  absl::StatusOr<CpuLayer> back = MakeCpuLayer(TestConfig(5));
  ASSERT_TRUE(back.ok());
  ASSERT_TRUE(LoadCheckpoint(back->layer.get(), dir2).ok());
  EXPECT_EQ(Snapshot(*back->layer), expected);
}

// A rank whose files are damaged makes every rank fail, and no rank changes its layer.
TEST(CheckpointEpTest, DamageOnOneRankFailsEveryRank) {
  const std::string dir = TempDir() + "/ep";
  absl::StatusOr<CpuLayer> one = MakeCpuLayer(TestConfig(1));
  ASSERT_TRUE(one.ok());
  ASSERT_TRUE(SaveCheckpoint(*one->layer, dir).ok());
  const std::string path = dir + "/" + ExpertFileName(6);  // owned by rank 1 at EP = 2
  std::string bytes = ReadWholeFile(path).value();
  WriteRaw(path, bytes.substr(0, bytes.size() / 2));
  RunEp(2, TestConfig(4), [&](int rank, MoeLayer* layer) {
    const auto before = Snapshot(*layer);
    absl::Status s = LoadCheckpoint(layer, dir);
    EXPECT_EQ(s.code(), rank == 1 ? absl::StatusCode::kDataLoss : absl::StatusCode::kAborted)
        << "rank " << rank << ": " << s;
    EXPECT_EQ(Snapshot(*layer), before) << "rank " << rank;
  });
}

}  // namespace
}  // namespace moe
