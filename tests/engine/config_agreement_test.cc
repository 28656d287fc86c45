// CheckConfigAgreement: ranks holding different layer configs all get FAILED_PRECONDITION
// (never a crash or a hang), ranks holding the same one get OK, and the communicator stays
// usable either way. Ranks are threads with real Gloo communicators over an in-memory store.
#include "engine/config_agreement.h"

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/comm/gloo_communicator.h"
#include "engine/comm/local_communicator.h"
#include "engine/comm/memory_kv_store.h"
#include "engine/cpu/cpu_backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/tiny_config.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

LayerConfig Base() { return TinyLayerConfig(); }

// Runs CheckConfigAgreement on `configs.size()` Gloo ranks (threads), then a Barrier on the
// same communicator; returns each rank's two statuses.
std::vector<std::pair<absl::Status, absl::Status>> Agree(const std::vector<LayerConfig>& configs,
                                                         const std::string& prefix) {
  const int size = static_cast<int>(configs.size());
  auto store = std::make_shared<MemoryKeyValueStore>();
  std::vector<std::pair<absl::Status, absl::Status>> out(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      CommOptions options;
      options.timeout = absl::Seconds(20);
      auto comm = MakeGlooCommunicator(store, prefix, r, size, options, {"", "127.0.0.1"});
      if (!comm.ok()) {
        out[r].first = comm.status();
        return;
      }
      std::unique_ptr<Backend> backend = MakeCpuBackend();
      out[r].first = CheckConfigAgreement(configs[r], backend.get(), comm->get());
      out[r].second = (*comm)->Barrier();
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(ConfigAgreementTest, SameConfigAgrees) {
  for (const auto& [first, barrier] : Agree({Base(), Base(), Base()}, "same")) {
    EXPECT_TRUE(first.ok()) << first;
    EXPECT_TRUE(barrier.ok()) << barrier;
  }
}

TEST(ConfigAgreementTest, EveryRankRefusesADifferentConfig) {
  // Sizes that would change the collectives' byte counts, and a coefficient that would not.
  const std::vector<std::function<void(LayerConfig*)>> edits = {
      [](LayerConfig* c) { c->num_experts = 4; },
      [](LayerConfig* c) { c->hidden = 48; },
      [](LayerConfig* c) { c->aux_loss_coeff = 1e-2; },
      [](LayerConfig* c) { c->init_seed = 1; },
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    SCOPED_TRACE(i);
    std::vector<LayerConfig> configs = {Base(), Base(), Base()};
    edits[i](&configs[2]);  // only the last rank differs
    const auto result = Agree(configs, absl::StrCat("differ", i));
    for (size_t r = 0; r < result.size(); ++r) {
      EXPECT_EQ(result[r].first.code(), absl::StatusCode::kFailedPrecondition)
          << "rank " << r << ": " << result[r].first;
      EXPECT_THAT(result[r].first.message(), HasSubstr("differs across the 3 ranks"));
      // Nothing was left half-done: the communicator still works.
      EXPECT_TRUE(result[r].second.ok()) << "rank " << r << ": " << result[r].second;
    }
  }
}

TEST(ConfigAgreementTest, FingerprintFollowsEveryField) {
  const uint64_t base = ConfigFingerprint(Base());
  EXPECT_EQ(ConfigFingerprint(Base()), base);
  LayerConfig c = Base();
  c.z_loss_coeff = 1e-3;
  EXPECT_NE(ConfigFingerprint(c), base);
  c = Base();
  c.compute_dtype = DType::kBFloat16;
  EXPECT_NE(ConfigFingerprint(c), base);
  c = Base();
  c.gated = false;
  EXPECT_NE(ConfigFingerprint(c), base);
}

TEST(ConfigAgreementTest, OneRankAndBadArguments) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::unique_ptr<Communicator> comm = MakeLocalCommunicator();
  EXPECT_TRUE(CheckConfigAgreement(Base(), backend.get(), comm.get()).ok());
  EXPECT_EQ(CheckConfigAgreement(Base(), nullptr, comm.get()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe
