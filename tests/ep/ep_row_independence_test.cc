// Two ranks (Gloo worker processes, the CPU backend with one thread each, as moed runs two CPU
// workers on two cores): a forward of several callers' tokens together, split between the
// ranks as moed splits a step (contiguous, in order), gives every caller, bit for bit, the rows
// of that caller's forward alone (split the same way). moed's cross-caller batching relies on
// it (server/README.md, "Cross-caller batching"); tests/engine/row_independence_test checks
// one rank. Token counts that are not multiples of 16 (the CPU GEMM's row block) move each
// token to another rank, another place in its expert's rows and another GEMM row block.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/comm/file_kv_store.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/moe_layer.h"
#include "gtest/gtest.h"
#include "tests/harness/multiprocess.h"

namespace moe {
namespace {

using harness::DecodeValues;
using harness::EncodeValues;
using harness::WorkerContext;
using harness::WriteResult;

struct Shape {
  std::string name;
  LayerConfig config;
  DType x_type = DType::kFloat32;
};

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  {
    Shape s;  // moectl bench's batching shape (gated SiLU)
    s.name = "h256";
    s.config.hidden = 256, s.config.ffn = 512, s.config.num_experts = 8, s.config.top_k = 2;
    s.config.init_seed = 3;
    shapes.push_back(s);
  }
  {
    Shape s;  // odd widths, GELU without gating, biases, align_size
    s.name = "h96_bias";
    s.config.hidden = 96, s.config.ffn = 160, s.config.num_experts = 4, s.config.top_k = 2;
    s.config.activation = Activation::kGelu, s.config.gated = false, s.config.use_bias = true;
    s.config.align_size = 8;
    s.config.init_seed = 5;
    shapes.push_back(s);
  }
  {
    Shape s;  // BF16 compute, BF16 input, k 3 of 8
    s.name = "h128_bf16";
    s.config.hidden = 128, s.config.ffn = 256, s.config.num_experts = 8, s.config.top_k = 3;
    s.config.compute_dtype = DType::kBFloat16;
    s.config.init_seed = 7;
    s.x_type = DType::kBFloat16;
    shapes.push_back(s);
  }
  return shapes;
}

// Callers' token counts of each merged step.
std::vector<std::vector<int64_t>> CallerSets() {
  return {{64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64},
          {13, 50, 7, 33, 64, 1, 29, 17},
          {5, 3, 40, 9, 21}};
}

// moed's token split (server/moe_service_steps.cc SplitRows).
std::vector<int64_t> Split(int64_t tokens, int ranks) {
  std::vector<int64_t> offsets(ranks + 1, 0);
  for (int r = 0; r < ranks; ++r) {
    offsets[r + 1] = offsets[r] + tokens / ranks + (r < tokens % ranks ? 1 : 0);
  }
  return offsets;
}

std::vector<float> Inputs(int64_t tokens, int64_t hidden, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(tokens * hidden));
  uint32_t state = seed * 2654435761u + 1;
  for (float& f : v) {
    state = state * 1664525u + 1013904223u;
    f = (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 4.0f;
  }
  return v;
}

// This rank's output bytes of a forward of rows [first, first + count) of `all`.
absl::StatusOr<std::string> ForwardSlice(MoeLayer& layer, const Shape& shape,
                                         const std::vector<float>& all, int64_t first,
                                         int64_t count, int rank, int ranks) {
  const int64_t H = shape.config.hidden;
  const std::vector<int64_t> off = Split(count, ranks);
  const int64_t begin = first + off[rank], end = first + off[rank + 1];
  Tensor x = Tensor::FromFloats({end - begin, H}, std::vector<float>(all.begin() + begin * H,
                                                                     all.begin() + end * H));
  if (shape.x_type != DType::kFloat32) x = x.ConvertTo(shape.x_type);
  absl::StatusOr<ForwardResult> fwd = layer.Forward(x, nullptr);
  if (!fwd.ok()) return fwd.status();
  return std::string(static_cast<const char*>(fwd->out.raw()), fwd->out.num_bytes());
}

// Per shape and caller set: "merged" (this rank's rows of the merged step) and "alone.<i>"
// (this rank's rows of caller i's forward alone).
MOED_WORKER(rows, const WorkerContext& ctx) {
  auto store = FileKeyValueStore::Create(ctx.store_dir);
  if (!store.ok()) return store.status();
  CommOptions options;
  options.timeout = absl::Seconds(60);
  auto comm = MakeGlooCommunicator(*store, "rows", ctx.rank, ctx.size, options,
                                   GlooTransportOptions{"", "127.0.0.1"});
  if (!comm.ok()) return comm.status();
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  for (const Shape& shape : Shapes()) {
    auto layer = MoeLayer::Create(shape.config, backend.get(), comm->get());
    if (!layer.ok()) return layer.status();
    const std::vector<std::vector<int64_t>> sets = CallerSets();
    for (size_t set = 0; set < sets.size(); ++set) {
      int64_t total = 0;
      for (int64_t t : sets[set]) total += t;
      const std::vector<float> all = Inputs(total, shape.config.hidden, 11 + set);
      const std::string prefix = absl::StrCat(shape.name, ".", set, ".");
      auto merged = ForwardSlice(**layer, shape, all, 0, total, ctx.rank, ctx.size);
      if (!merged.ok()) return merged.status();
      if (absl::Status s = WriteResult(ctx, prefix + "merged", *merged); !s.ok()) return s;
      int64_t first = 0;
      for (size_t i = 0; i < sets[set].size(); ++i) {
        auto alone = ForwardSlice(**layer, shape, all, first, sets[set][i], ctx.rank, ctx.size);
        if (!alone.ok()) return alone.status();
        if (absl::Status s = WriteResult(ctx, absl::StrCat(prefix, "alone.", i), *alone);
            !s.ok()) {
          return s;
        }
        first += sets[set][i];
      }
    }
  }
  return absl::OkStatus();
}

TEST(EpRowIndependenceTest, MergedRowsEqualEachCallerAloneOnTwoRanks) {
  // One OpenBLAS thread per rank, as moed's launcher gives two CPU workers on two cores.
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  harness::LaunchOptions launch;
  launch.worker = "rows";
  launch.size = 2;
  launch.deadline = absl::Seconds(240);
  auto run = harness::RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(run->AllSucceeded()) << run->Summary();
  const int ranks = launch.size;
  auto read = [&](int rank, const std::string& name) {
    auto bytes = harness::ReadResult(run->ranks[rank], name);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *bytes : std::string();
  };
  for (const Shape& shape : Shapes()) {
    const size_t row_bytes = shape.config.hidden * DTypeSize(shape.x_type);
    const std::vector<std::vector<int64_t>> sets = CallerSets();
    for (size_t set = 0; set < sets.size(); ++set) {
      const std::string prefix = absl::StrCat(shape.name, ".", set, ".");
      std::string merged;
      for (int r = 0; r < ranks; ++r) merged += read(r, prefix + "merged");
      int64_t first = 0, differing = 0;
      for (size_t i = 0; i < sets[set].size(); ++i) {
        std::string alone;
        for (int r = 0; r < ranks; ++r) alone += read(r, absl::StrCat(prefix, "alone.", i));
        ASSERT_EQ(alone.size(), sets[set][i] * row_bytes);
        ASSERT_GE(merged.size(), (first + sets[set][i]) * row_bytes);
        for (int64_t t = 0; t < sets[set][i]; ++t) {
          if (std::memcmp(alone.data() + t * row_bytes,
                          merged.data() + (first + t) * row_bytes, row_bytes) != 0) {
            ++differing;
            if (differing <= 5) {
              ADD_FAILURE() << prefix << " caller " << i << " row " << t << " (merged row "
                            << first + t << ") differs from the caller's forward alone";
            }
          }
        }
        first += sets[set][i];
      }
      EXPECT_EQ(differing, 0) << prefix << ": rows differing";
    }
  }
}

}  // namespace
}  // namespace moe
