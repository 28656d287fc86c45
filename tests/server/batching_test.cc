// moed + 2 real moe-workers: cross-caller batching of forwards (server/forward_batcher.h,
// server/moe_service_batching.cc). Concurrent inference callers share merged steps (seen in
// moed_merged_forward_callers) and each gets exactly what its forward alone gives: the same
// bits of out, its own tokens_per_expert and load, its own error. Layers whose results are
// batch statistics (capacity, aux / z losses) are never merged.
//
// The reference of every request is the same request sent `unbatched` (a worker step of its
// own, as every forward was before batching).
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"

#include "gtest/gtest.h"
#include "tests/server/cluster_fixture.h"
#include "tests/server/metrics_scrape.h"

namespace moe {
namespace {

v1::LayerConfig BatchableConfig(uint64_t seed) {
  v1::LayerConfig c;
  c.set_hidden(256);  // past OpenBLAS's small-matrix sizes (engine/cpu/cpu_gemm.cc)
  c.set_ffn(512);
  c.set_num_experts(8);
  c.set_top_k(2);
  c.set_init_seed(seed);
  return c;
}

// Caller i's request: its own token count and dtype; some rows NaN for caller 5.
v1::Tensor CallerInput(int i, int64_t hidden) {
  const int64_t tokens = 1 + (i * 7) % 37;
  std::vector<float> values = RandomFloats(tokens * hidden, 100 + i);
  if (i == 5) values[3] = std::numeric_limits<float>::quiet_NaN();
  v1::Tensor x = FloatsToProto({tokens, hidden}, values);
  if (i % 3 == 2) {  // BF16: its own batches (the key is layer and dtype)
    TensorToProto(Tensor::FromFloats({tokens, hidden}, values).ConvertTo(DType::kBFloat16), &x);
  }
  return x;
}

// The fields of a forward's answer that differ from the caller's reference ("" if none).
std::string Difference(const v1::ForwardResponse& got, const v1::ForwardResponse& want) {
  std::string diff;
  if (got.out().raw_data() != want.out().raw_data()) diff += " out";
  if (got.out().datatype() != want.out().datatype() ||
      got.out().shape_size() != 2 || got.out().shape(0) != want.out().shape(0)) {
    diff += " out's head";
  }
  if (got.load().SerializeAsString() != want.load().SerializeAsString()) diff += " load";
  if (std::vector<int64_t>(got.tokens_per_expert().begin(), got.tokens_per_expert().end()) !=
      std::vector<int64_t>(want.tokens_per_expert().begin(), want.tokens_per_expert().end())) {
    diff += " tokens_per_expert";
  }
  auto same = [](double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  if (!same(got.aux_loss(), want.aux_loss())) {
    diff += absl::StrCat(" aux_loss ", got.aux_loss(), " != ", want.aux_loss());
  }
  if (!same(got.z_loss(), want.z_loss())) {
    diff += absl::StrCat(" z_loss ", got.z_loss(), " != ", want.z_loss());
  }
  return diff;
}

class BatchingTest : public ClusterTest {
 protected:
  // The shared cluster with moed's default flags (batching on) and a metrics port.
  static void SetUpTestSuite() {
    metrics_port_ = FreePort();
    ClusterOptions options;
    options.workers = 2;
    options.moed_flags = {absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port_)};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  grpc::Status Forward(const std::string& layer, const v1::Tensor& x, bool unbatched,
                       v1::ForwardResponse* response, int deadline_ms = 20000) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    v1::ForwardRequest request;
    request.set_layer(layer);
    *request.mutable_x() = x;
    request.set_unbatched(unbatched);
    return stub()->Forward(&ctx, request, response);
  }
  double Merged(const std::string& layer, const std::string& suffix) {
    return Sample(ScrapeMetrics(metrics_port_),
                  "moed_merged_forward_callers_" + suffix + "{layer=\"" + layer + "\"}");
  }
  // Every caller sends its request `rounds` times at once with the others; each answer is
  // compared with the caller's reference. `bad` callers send a request that must fail alone.
  void RunCallers(const std::string& layer, int callers, int rounds,
                  const std::vector<v1::Tensor>& inputs,
                  const std::vector<v1::ForwardResponse>& want, const std::vector<bool>& bad) {
    std::vector<std::thread> threads;
    std::atomic<int> mismatches{0}, failures{0}, unexpected_ok{0};
    for (int i = 0; i < callers; ++i) {
      threads.emplace_back([&, i] {
        for (int round = 0; round < rounds; ++round) {
          v1::ForwardResponse got;
          grpc::Status s = Forward(layer, inputs[i], /*unbatched=*/false, &got);
          if (bad[i]) {
            if (s.ok() || s.error_code() != grpc::StatusCode::INVALID_ARGUMENT) ++unexpected_ok;
            continue;
          }
          if (!s.ok()) {
            ADD_FAILURE() << "caller " << i << ": " << s.error_message();
            ++failures;
            continue;
          }
          const std::string diff = Difference(got, want[i]);
          if (!diff.empty()) {
            ADD_FAILURE() << layer << " caller " << i << " round " << round << ": " << diff;
            ++mismatches;
          }
        }
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(mismatches.load(), 0);
    EXPECT_EQ(failures.load(), 0);
    EXPECT_EQ(unexpected_ok.load(), 0);
  }
  std::vector<v1::ForwardResponse> References(const std::string& layer,
                                              const std::vector<v1::Tensor>& inputs,
                                              const std::vector<bool>& bad) {
    std::vector<v1::ForwardResponse> want(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (bad[i]) continue;
      grpc::Status s = Forward(layer, inputs[i], /*unbatched=*/true, &want[i]);
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    return want;
  }
};

TEST_F(BatchingTest, MergedForwardsAreBitIdenticalToEachCallerAlone) {
  ASSERT_TRUE(Create("batched", BatchableConfig(7)).ok());
  constexpr int kCallers = 12;
  std::vector<v1::Tensor> inputs;
  std::vector<bool> bad(kCallers, false);
  for (int i = 0; i < kCallers; ++i) inputs.push_back(CallerInput(i, 256));
  const std::vector<v1::ForwardResponse> want = References("batched", inputs, bad);
  ASSERT_EQ(Merged("batched", "count"), 0);  // the references ran alone
  // Rounds until some step merged callers (each round is likely to; bounded).
  for (int attempt = 0; attempt < 10 && Merged("batched", "sum") <= Merged("batched", "count");
       ++attempt) {
    RunCallers("batched", kCallers, 4, inputs, want, bad);
  }
  EXPECT_GT(Merged("batched", "sum"), Merged("batched", "count"))
      << "no step merged two callers";
  // The caller with a NaN row gets NaN in that row's output only (row independence).
  const std::vector<float> out5 = ProtoToFloats(want[5].out());
  for (int64_t j = 0; j < 256; ++j) EXPECT_TRUE(std::isnan(out5[j])) << j;
  for (size_t j = 256; j < out5.size(); ++j) EXPECT_FALSE(std::isnan(out5[j])) << j;
}

// moectl bench --callers=16's shape: 64 tokens per caller, each caller's tokens on both
// workers alone and on one of them merged, at places that are not multiples of the CPU GEMM's
// row block (the ~1e-6 differences of engine/cpu/cpu_gemm.cc's fixed 16-row blocks).
TEST_F(BatchingTest, SixteenCallersOf64TokensAreBitIdentical) {
  ASSERT_TRUE(Create("wide", BatchableConfig(12)).ok());
  constexpr int kCallers = 16;
  std::vector<v1::Tensor> inputs;
  std::vector<bool> bad(kCallers, false);
  for (int i = 0; i < kCallers; ++i) {
    const int64_t tokens = i % 4 == 3 ? 61 : 64;
    inputs.push_back(FloatsToProto({tokens, 256}, RandomFloats(tokens * 256, 300 + i)));
  }
  const std::vector<v1::ForwardResponse> want = References("wide", inputs, bad);
  for (int attempt = 0; attempt < 10 && Merged("wide", "sum") <= Merged("wide", "count");
       ++attempt) {
    RunCallers("wide", kCallers, 3, inputs, want, bad);
  }
  EXPECT_GT(Merged("wide", "sum"), Merged("wide", "count")) << "no step merged two callers";
}

TEST_F(BatchingTest, BadRequestsFailAloneAndNeverTheBatch) {
  ASSERT_TRUE(Create("mixed", BatchableConfig(8)).ok());
  constexpr int kCallers = 10;
  std::vector<v1::Tensor> inputs;
  std::vector<bool> bad(kCallers, false);
  for (int i = 0; i < kCallers; ++i) inputs.push_back(CallerInput(i, 256));
  inputs[1] = FloatsToProto({4, 32}, RandomFloats(128, 1));  // wrong hidden size
  inputs[4].set_datatype("FP16");                              // not FP32 / BF16
  inputs[7].mutable_raw_data()->pop_back();                    // bytes != shape
  bad[1] = bad[4] = bad[7] = true;
  const std::vector<v1::ForwardResponse> want = References("mixed", inputs, bad);
  for (int attempt = 0; attempt < 10 && Merged("mixed", "sum") <= Merged("mixed", "count");
       ++attempt) {
    RunCallers("mixed", kCallers, 4, inputs, want, bad);
  }
  EXPECT_GT(Merged("mixed", "sum"), Merged("mixed", "count"));
}

// Callers whose deadline passes (or who give up) while waiting leave; the others' answers
// are whole and right.
TEST_F(BatchingTest, CallersThatLeaveDoNotDisturbTheBatch) {
  ASSERT_TRUE(Create("leaving", BatchableConfig(9)).ok());
  constexpr int kCallers = 8;
  std::vector<v1::Tensor> inputs;
  std::vector<bool> bad(kCallers, false);
  for (int i = 0; i < kCallers; ++i) inputs.push_back(CallerInput(i, 256));
  const std::vector<v1::ForwardResponse> want = References("leaving", inputs, bad);
  std::atomic<bool> stop{false};
  std::thread impatient([&] {
    while (!stop) {
      v1::ForwardResponse got;
      grpc::Status s = Forward("leaving", inputs[0], false, &got, /*deadline_ms=*/1);
      if (s.ok()) {
        EXPECT_EQ(got.out().raw_data(), want[0].out().raw_data());
      }
    }
  });
  RunCallers("leaving", kCallers, 6, inputs, want, bad);
  stop = true;
  impatient.join();
}

// Capacity, aux loss and z-loss are statistics of the step's tokens: such layers never merge
// (a merged capacity step would drop other tokens, a merged loss would mix callers).
TEST_F(BatchingTest, BatchDependentLayersAreNotMerged) {
  v1::LayerConfig capacity = BatchableConfig(10);
  capacity.set_capacity_factor(1.0);
  v1::LayerConfig losses = BatchableConfig(11);
  losses.set_aux_loss_coeff(1e-2);
  losses.set_z_loss_coeff(1e-3);
  ASSERT_TRUE(Create("capacity", capacity).ok());
  ASSERT_TRUE(Create("losses", losses).ok());
  constexpr int kCallers = 8;
  std::vector<v1::Tensor> inputs;
  std::vector<bool> bad(kCallers, false);
  for (int i = 0; i < kCallers; ++i) inputs.push_back(CallerInput(i, 256));
  for (const std::string layer : {"capacity", "losses"}) {
    const std::vector<v1::ForwardResponse> want = References(layer, inputs, bad);
    RunCallers(layer, kCallers, 4, inputs, want, bad);
    EXPECT_EQ(Merged(layer, "count"), 0) << layer;
  }
}

}  // namespace
}  // namespace moe
