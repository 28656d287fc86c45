// A forward's output rows depend on their own tokens only (one rank, the CPU backend): the
// rows of a forward of several callers' tokens together equal, bit for bit, each caller's
// forward alone. moed's cross-caller batching relies on it (server/README.md).
#include <cstring>
#include <memory>
#include <vector>

#include "engine/comm/local_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/moe_layer.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(RowIndependenceTest, MergedForwardRowsEqualEachPartAlone) {
  LayerConfig config;
  config.hidden = 256;
  config.ffn = 512;
  config.num_experts = 8;
  config.top_k = 2;
  config.init_seed = 3;
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  std::unique_ptr<Communicator> comm = MakeLocalCommunicator();
  auto layer = MoeLayer::Create(config, backend.get(), comm.get());
  ASSERT_TRUE(layer.ok()) << layer.status();
  const int64_t tokens = 256, H = config.hidden;
  std::vector<float> values(tokens * H);
  uint32_t state = 12345;
  for (float& v : values) {
    state = state * 1664525u + 1013904223u;
    v = static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
  }
  const Tensor all = Tensor::FromFloats({tokens, H}, values);
  auto merged = (*layer)->Forward(all, nullptr);
  ASSERT_TRUE(merged.ok()) << merged.status();
  for (int64_t part : {1, 7, 16, 64, 100}) {
    for (int64_t first = 0; first + part <= tokens; first += part * 3 + 1) {
      const Tensor x = Tensor::FromFloats(
          {part, H}, std::vector<float>(values.begin() + first * H,
                                        values.begin() + (first + part) * H));
      auto alone = (*layer)->Forward(x, nullptr);
      ASSERT_TRUE(alone.ok()) << alone.status();
      EXPECT_EQ(std::memcmp(alone->out.raw(),
                            static_cast<const char*>(merged->out.raw()) + first * H * 4,
                            part * H * 4),
                0)
          << "rows " << first << "+" << part;
    }
  }
}

}  // namespace
}  // namespace moe
