// A checkpoint saved at EP=2 loads at EP=4 and EP=1 (separate Gloo processes): the forward
// right after loading equals the EP=2 forward right after saving, and one more AdamW training
// step from the loaded state (parameters, expert bias and optimizer state) equals the EP=2
// run's continued training. The checkpoint stores experts, not ranks (engine/checkpoint.h).
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/checkpoint.h"
#include "engine/comm/file_kv_store.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/status_macros.h"
#include "gtest/gtest.h"
#include "tests/ep/ep_cases.h"
#include "tests/harness/multiprocess.h"

namespace moe {
namespace ep_test {
namespace {

using harness::DecodeValues;
using harness::EncodeValues;
using harness::ReadResult;
using harness::WorkerContext;
using harness::WriteResult;

// Grouped sigmoid with expert bias and biases, dropless (so that a training step is the same
// computation at every EP size).
EpCase CheckpointCase() {
  for (const EpCase& c : EpCases(1)) {
    if (c.name == "sigmoid_grouped_align0_dropless") return c;
  }
  return EpCase{};
}

// Forward + backward on this rank's slice, then one AdamW step.
absl::Status TrainStep(const EpCase& c, MoeLayer* layer, const Tensor& x, const Tensor& d_out) {
  std::unique_ptr<StepContext> saved;
  ASSIGN_OR_RETURN(ForwardResult fwd, layer->Forward(x, &saved));
  RETURN_IF_ERROR(layer->Backward(*saved, d_out, c.d_aux, c.d_zl).status());
  RETURN_IF_ERROR(layer->UpdateExpertBias(0.01));
  return layer->ApplyOptimizer(OptimizerConfig::AdamW(0.01, 0.01));
}

absl::Status WriteForward(const WorkerContext& ctx, MoeLayer* layer, const Tensor& x,
                          const std::string& name) {
  ASSIGN_OR_RETURN(ForwardResult fwd, layer->Forward(x, nullptr));
  return WriteResult(ctx, name, std::string(fwd.out.bytes()));
}

// mode "save": train one step, save to ckpt, forward ("out_at_save"), train one more step,
//              forward ("out_trained").
// mode "load": a layer of another seed loads ckpt, forward ("out_at_load"), trains the same
//              second step, forward ("out_trained").
MOED_WORKER(ep_checkpoint, const WorkerContext& ctx) {
  auto store = FileKeyValueStore::Create(ctx.store_dir);
  if (!store.ok()) return store.status();
  CommOptions options;
  options.timeout = absl::Seconds(30);
  ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                   MakeGlooCommunicator(*store, "ckpt", ctx.rank, ctx.size, options,
                                        GlooTransportOptions{"", "127.0.0.1"}));
  const EpCase c = CheckpointCase();
  const std::vector<int64_t> offsets = SliceOffsets(c, ctx.size);
  const int64_t begin = offsets[ctx.rank], end = offsets[ctx.rank + 1];
  const Tensor x = CaseRows(c, CaseInput(c), begin, end);
  const Tensor d_out = CaseRows(c, CaseOutputGradient(c), begin, end);
  const std::string dir = ctx.Param("ckpt");
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  LayerConfig config = c.config;
  if (ctx.Param("mode") == "load") config.init_seed += 7;  // the load must replace everything
  ASSIGN_OR_RETURN(std::unique_ptr<MoeLayer> layer,
                   MoeLayer::Create(config, backend.get(), comm.get()));
  if (ctx.Param("mode") == "save") {
    RETURN_IF_ERROR(SetCaseParameters(c, layer.get()));
    RETURN_IF_ERROR(TrainStep(c, layer.get(), x, d_out));
    RETURN_IF_ERROR(SaveCheckpoint(*layer, dir));
    RETURN_IF_ERROR(WriteForward(ctx, layer.get(), x, "out_at_save"));
  } else {
    RETURN_IF_ERROR(LoadCheckpoint(layer.get(), dir));
    RETURN_IF_ERROR(WriteForward(ctx, layer.get(), x, "out_at_load"));
  }
  RETURN_IF_ERROR(TrainStep(c, layer.get(), x, d_out));
  return WriteForward(ctx, layer.get(), x, "out_trained");
}

// The ranks' slices of a result, concatenated: the whole batch's rows.
std::vector<float> Gather(const harness::LaunchResult& run, const std::string& name) {
  std::vector<float> all;
  for (const harness::RankResult& rank : run.ranks) {
    auto bytes = ReadResult(rank, name);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    if (!bytes.ok()) return {};
    auto values = DecodeValues<float>(*bytes);
    all.insert(all.end(), values->begin(), values->end());
  }
  return all;
}

absl::StatusOr<harness::LaunchResult> Launch(int ranks, const std::string& mode,
                                             const std::string& dir) {
  harness::LaunchOptions launch;
  launch.worker = "ep_checkpoint";
  launch.size = ranks;
  launch.params = {{"mode", mode}, {"ckpt", dir}};
  launch.deadline = absl::Seconds(40);
  return harness::RunWorkers(launch);
}

TEST(EpCheckpointTest, SavedAtEp2LoadsAtEp4AndEp1) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/ep_ckpt_", getpid(), "_",
                                       absl::ToUnixMicros(absl::Now()));
  auto saved = Launch(2, "save", dir);
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_TRUE(saved->AllSucceeded()) << saved->Summary();
  const std::vector<float> at_save = Gather(*saved, "out_at_save");
  const std::vector<float> trained = Gather(*saved, "out_trained");
  const EpCase c = CheckpointCase();
  ASSERT_EQ(at_save.size(), static_cast<size_t>(c.global_tokens * c.config.hidden));
  // The second step changed the outputs, so comparing after it tests the optimizer state.
  EXPECT_GT(MaxRelativeError(trained, at_save), 1e-3);

  for (const int ranks : {4, 1}) {
    SCOPED_TRACE(absl::StrCat("loaded at EP=", ranks));
    auto loaded = Launch(ranks, "load", dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ASSERT_TRUE(loaded->AllSucceeded()) << loaded->Summary();
    EXPECT_LE(MaxRelativeError(Gather(*loaded, "out_at_load"), at_save), 1e-5);
    EXPECT_LE(MaxRelativeError(Gather(*loaded, "out_trained"), trained), 1e-5);
  }
}

}  // namespace
}  // namespace ep_test
}  // namespace moe
