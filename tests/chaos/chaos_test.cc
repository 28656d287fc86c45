// Chaos (issue 14): kClients trainers run forward, backward and a conditional optimizer step
// on small durable layers (one each, plus one they share) while a driver SIGKILLs workers,
// SIGSTOPs one for longer than the step deadline and restarts moed on the same --state_dir,
// at seeded random points (the seed is printed; CHAOS_SEED overrides it). At the end:
//   - every layer's weights equal, bit for bit, a local engine replay (2 ranks as threads
//     over Gloo, the workers' token split) of exactly the optimizer steps the server says the
//     layer holds (LayerInfo.optimizer_step);
//   - that step, and the durable step, are never below the highest step any response
//     acknowledged as durable (checked after every failure too, not only at the end): the
//     acknowledged durable steps lost are counted and must be 0;
//   - no call waited past its deadline (plus kDeadlineSlack).
// It prints the figures: faults by kind, failed calls by method and code, recovery time
// p50/p99, steps retrained and steps replayed.
//
// Why the replay is exact: a step's inputs are a function of (layer, step number), and the
// client sends ApplyOptimizer with expected_optimizer_step, which moed refuses (ABORTED) when
// the layer is at another step or its gradients were dropped by a re-formation or restart
// since the client's ZeroGradients. So optimizer step s of a layer always used the inputs of
// step s on the weights of step s - 1, whatever failed in between.
//
// Client retry policy: every call has the deadline kCallDeadline. After any failure the
// client releases its kept step (best effort), backs off (100 ms doubling to 800 ms), reads
// the layer's optimizer step (GetLayer), calls ZeroGradients, and runs the step again with
// the inputs of that step + 1.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/chaos/chaos_replay.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

constexpr int kWorkers = 2;
constexpr int kClients = 3;
constexpr int kMinSteps = 8;  // every client's own layer reaches at least this step
constexpr int kFaultsPerKind = 3;  // CHAOS_FAULTS_PER_KIND overrides (0: a fault-free control)
constexpr int kStepTimeoutMs = 1500;
constexpr absl::Duration kCallDeadline = absl::Seconds(5);
constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(750);

int FaultsPerKind() {
  const char* value = std::getenv("CHAOS_FAULTS_PER_KIND");
  return value != nullptr ? std::atoi(value) : kFaultsPerKind;
}

// Clients stop trying after it: 70 s for the 9 faults of the short form, 5.5 s more per fault
// (the slowest recoveries are ~5.3 s).
absl::Duration TestBudget() { return absl::Seconds(20 + 5.5 * 3 * FaultsPerKind()); }

// Shared figures of the run and its violations. Thread-safe.
class Figures {
 public:
  void CountCall(const std::string& method, grpc::StatusCode code, absl::Duration took,
                 absl::Duration deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    if (code != grpc::StatusCode::OK) ++failed_[absl::StrCat(method, " code ", code)];
    if (took > deadline + kDeadlineSlack) {
      violations_.push_back(absl::StrCat(method, " took ", absl::FormatDuration(took),
                                         " with a deadline of ", absl::FormatDuration(deadline)));
    }
  }
  void Violation(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    violations_.push_back(what);
  }
  // A step acknowledged at `acked` whose attempt (after any failure) began at `began`.
  void StepDone(absl::Time began, absl::Time acked) {
    std::lock_guard<std::mutex> lock(mu_);
    steps_.push_back({began, acked});
  }
  void Retrained(int64_t steps) { retrained_ += steps; }
  // Steps acknowledged as durable that a layer no longer holds.
  void Lost(int64_t steps) { lost_ += steps; }
  // Time from `fault` to the first acknowledged step that began after it; -1: none yet.
  double RecoverySeconds(absl::Time fault) {
    std::lock_guard<std::mutex> lock(mu_);
    absl::Time first = absl::InfiniteFuture();
    for (const auto& [began, acked] : steps_) {
      if (began >= fault) first = std::min(first, acked);
    }
    return first == absl::InfiniteFuture() ? -1 : absl::ToDoubleSeconds(first - fault);
  }
  std::vector<std::string> violations() {
    std::lock_guard<std::mutex> lock(mu_);
    return violations_;
  }
  std::string FailedText() {
    std::lock_guard<std::mutex> lock(mu_);
    std::string text;
    int total = 0;
    for (const auto& [what, n] : failed_) {
      absl::StrAppend(&text, text.empty() ? "" : ", ", what, ": ", n);
      total += n;
    }
    return absl::StrCat(total, " (", text, ")");
  }
  int64_t retrained() const { return retrained_; }
  int64_t lost() const { return lost_; }

 private:
  std::mutex mu_;
  std::map<std::string, int> failed_;
  std::vector<std::string> violations_;
  std::vector<std::pair<absl::Time, absl::Time>> steps_;
  std::atomic<int64_t> retrained_{0};
  std::atomic<int64_t> lost_{0};
};

// One layer as its trainers see it. Fields after `mu` are guarded by it (a shared layer's
// clients take one step at a time, so its gradients are one step's).
struct TrainedLayer {
  ChaosLayer plan;
  std::mutex mu;
  int64_t known_step = 0;     // the layer's optimizer step as last seen
  int64_t acked_durable = 0;  // highest durable_optimizer_step acknowledged
  bool needs_resync = false;  // a call failed: read the step and zero the gradients
};

// A trainer with its own channel (short reconnect backoff: moed comes back within seconds).
class Trainer {
 public:
  Trainer(const std::string& address, Figures* figures) : figures_(figures) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // its own connection
    stub_ = v1::MoeService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }

  // Trains one step of `layer` (its lock held by the caller) until it is acknowledged or
  // `give_up` passes.
  bool TrainStep(TrainedLayer& layer, absl::Time give_up) {
    absl::Duration backoff = absl::Milliseconds(100);
    while (absl::Now() < give_up) {
      const absl::Time began = absl::Now();
      if (Attempt(layer)) {
        figures_->StepDone(began, absl::Now());
        return true;
      }
      layer.needs_resync = true;
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Milliseconds(800));
    }
    return false;
  }

 private:
  // Runs `call(context)` under kCallDeadline and books its code and duration.
  template <typename Call>
  grpc::Status Timed(const char* method, Call call) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
    const absl::Time start = absl::Now();
    grpc::Status status = call(&context);
    figures_->CountCall(method, status.error_code(), absl::Now() - start, kCallDeadline);
    return status;
  }

  // GetLayer, then ZeroGradients: the layer's current step, and no gradients of a failed try.
  bool Resync(TrainedLayer& layer) {
    v1::GetLayerRequest get;
    get.set_name(layer.plan.name);
    v1::GetLayerResponse got;
    if (!Timed("GetLayer", [&](auto* c) { return stub_->GetLayer(c, get, &got); }).ok()) {
      return false;
    }
    const v1::LayerInfo& info = got.layer();
    if (info.optimizer_step() < layer.acked_durable ||
        info.durable_optimizer_step() < layer.acked_durable) {
      const int64_t held = std::min(info.optimizer_step(), info.durable_optimizer_step());
      figures_->Lost(layer.acked_durable - held);
      figures_->Violation(absl::StrCat(layer.plan.name, ": at step ", info.optimizer_step(),
                                       " (durable ", info.durable_optimizer_step(), ") after step ",
                                       layer.acked_durable, " was acknowledged as durable"));
      layer.acked_durable = held;  // counted once (the violation fails the test)
    }
    if (info.optimizer_step() < layer.known_step) {
      figures_->Retrained(layer.known_step - info.optimizer_step());
    }
    layer.known_step = info.optimizer_step();
    v1::ZeroGradientsRequest zero;
    zero.set_layer(layer.plan.name);
    v1::ZeroGradientsResponse zeroed;
    if (!Timed("ZeroGradients", [&](auto* c) {
           return stub_->ZeroGradients(c, zero, &zeroed);
         }).ok()) {
      return false;
    }
    layer.needs_resync = false;
    return true;
  }

  // Forward + Backward of step known_step + 1, then the conditional ApplyOptimizer.
  bool Attempt(TrainedLayer& layer) {
    if (layer.needs_resync && !Resync(layer)) return false;
    const int64_t step = layer.known_step + 1;
    const StepInputs inputs = ChaosInputs(layer.plan, step);
    v1::ForwardRequest forward;
    forward.set_layer(layer.plan.name);
    *forward.mutable_x() = FloatsToProto({kChaosTokens, inputs.hidden}, inputs.x);
    forward.set_keep_for_backward(true);
    v1::ForwardResponse forwarded;
    if (!Timed("Forward", [&](auto* c) { return stub_->Forward(c, forward, &forwarded); }).ok()) {
      return false;
    }
    v1::BackwardRequest backward;
    backward.set_layer(layer.plan.name);
    backward.set_step_id(forwarded.step_id());
    *backward.mutable_d_out() = FloatsToProto({kChaosTokens, inputs.hidden}, inputs.d_out);
    v1::BackwardResponse backwarded;
    if (!Timed("Backward", [&](auto* c) {
           return stub_->Backward(c, backward, &backwarded);
         }).ok()) {
      Release(layer, forwarded.step_id());
      return false;
    }
    return Apply(layer, step);
  }

  bool Apply(TrainedLayer& layer, int64_t step) {
    v1::ApplyOptimizerRequest apply = layer.plan.optimizer;
    apply.set_layer(layer.plan.name);
    apply.set_expected_optimizer_step(step - 1);
    v1::ApplyOptimizerResponse applied;
    if (!Timed("ApplyOptimizer", [&](auto* c) {
           return stub_->ApplyOptimizer(c, apply, &applied);
         }).ok()) {
      return false;
    }
    if (applied.optimizer_step() != step) {
      figures_->Violation(absl::StrCat(layer.plan.name, ": conditional step ", step,
                                       " answered optimizer_step ", applied.optimizer_step()));
    }
    layer.known_step = applied.optimizer_step();
    layer.acked_durable = std::max(layer.acked_durable, applied.durable_optimizer_step());
    return true;
  }

  void Release(TrainedLayer& layer, uint64_t step_id) {
    v1::ReleaseStepRequest release;
    release.set_layer(layer.plan.name);
    release.set_step_id(step_id);
    v1::ReleaseStepResponse released;
    Timed("ReleaseStep", [&](auto* c) { return stub_->ReleaseStep(c, release, &released); });
  }

  Figures* figures_;
  std::unique_ptr<v1::MoeService::Stub> stub_;
};

enum class Fault { kKillWorker, kStopWorker, kRestartMoed };
const char* FaultName(Fault fault) {
  switch (fault) {
    case Fault::kKillWorker:
      return "SIGKILL worker";
    case Fault::kStopWorker:
      return "SIGSTOP worker";
    case Fault::kRestartMoed:
      return "restart moed";
  }
  return "?";
}

class ChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    state_dir_ = absl::StrCat(tmp ? tmp : "/tmp", "/chaos_", getpid(), "/state");
    const char* seed = std::getenv("CHAOS_SEED");
    seed_ = seed != nullptr ? std::strtoul(seed, nullptr, 10) : 20261201;
    std::printf("chaos: seed %u (CHAOS_SEED=%u reproduces the fault schedule)\n", seed_, seed_);
    ClusterOptions options;
    options.workers = kWorkers;
    // Pings decide liveness (a stop shorter than --worker_dead_after_ms is a slow worker, a
    // step past its deadline); durable every 3 steps so restarts roll layers back. Step
    // tensors go through moed's shared-memory relay (the default with workers on its host).
    options.moed_flags = {"--state_dir=" + state_dir_,
                          "--durable_every_steps=3",
                          "--durable_every_s=0",
                          absl::StrCat("--step_timeout_ms=", kStepTimeoutMs),
                          "--worker_dead_after_ms=4000",
                          "--metrics_listen=off"};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  void CreateLayers() {
    for (int i = 0; i <= kClients; ++i) {
      auto layer = std::make_unique<TrainedLayer>();
      layer->plan = ChaosLayerPlan(i, /*shared=*/i == kClients);
      grpc::ClientContext context;
      v1::CreateLayerRequest request;
      request.set_name(layer->plan.name);
      *request.mutable_config() = layer->plan.config;
      v1::CreateLayerResponse response;
      ASSERT_TRUE(cluster_->stub()->CreateLayer(&context, request, &response).ok());
      layers_.push_back(std::move(layer));
    }
  }

  // Client c: its own layer, and every third step the shared one, until the driver is done
  // and its layer reached kMinSteps (or the budget is spent).
  void RunClient(int c, absl::Time give_up) {
    Trainer trainer(cluster_->address(), &figures_);
    TrainedLayer& own = *layers_[c];
    TrainedLayer& shared = *layers_[kClients];
    for (int i = 0; absl::Now() < give_up; ++i) {
      if (driver_done_ && own.known_step >= kMinSteps) break;
      TrainedLayer& layer = i % 3 == 2 ? shared : own;
      std::lock_guard<std::mutex> lock(layer.mu);
      trainer.TrainStep(layer, give_up);
      absl::SleepFor(absl::Milliseconds(20));  // leave CPU to moed and the workers
    }
  }

  // The fault schedule: each kind kFaultsPerKind times, in a seeded order, at seeded random
  // points.
  void RunDriver() {
    std::mt19937 random(seed_);
    std::vector<Fault> faults;
    for (Fault kind : {Fault::kKillWorker, Fault::kStopWorker, Fault::kRestartMoed}) {
      faults.insert(faults.end(), FaultsPerKind(), kind);
    }
    std::shuffle(faults.begin(), faults.end(), random);
    for (Fault fault : faults) {
      absl::SleepFor(absl::Milliseconds(300 + random() % 900));
      const int victim = static_cast<int>(random() % kWorkers);
      const absl::Time injected = absl::Now();
      Inject(fault, victim, random);
      absl::Status serving = cluster_->WaitServing(absl::Seconds(30));
      if (!serving.ok())
        figures_.Violation(absl::StrCat(FaultName(fault), ": ", serving.message()));
      recovery_s_[FaultName(fault)].push_back(WaitRecovered(injected));
    }
    driver_done_ = true;
  }

  void Inject(Fault fault, int victim, std::mt19937& random) {
    switch (fault) {
      case Fault::kKillWorker:
        cluster_->KillWorker(victim, SIGKILL);
        absl::SleepFor(absl::Milliseconds(random() % 300));
        EXPECT_TRUE(cluster_->RestartWorker(victim).ok());
        break;
      case Fault::kStopWorker:
        EXPECT_TRUE(cluster_->KillWorker(victim, SIGSTOP));
        absl::SleepFor(absl::Milliseconds(kStepTimeoutMs + 300 + random() % 900));
        cluster_->KillWorker(victim, SIGCONT);
        break;
      case Fault::kRestartMoed:
        EXPECT_TRUE(cluster_->RestartMoed().ok());
        break;
    }
  }

  // Seconds until a step that began after `injected` was acknowledged (at most 30 s).
  double WaitRecovered(absl::Time injected) {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (absl::Now() < give_up) {
      const double seconds = figures_.RecoverySeconds(injected);
      if (seconds >= 0) return seconds;
      absl::SleepFor(absl::Milliseconds(20));
    }
    figures_.Violation("no step was acknowledged within 30 s of a fault");
    return 30;
  }

  // The end state of `layer`: its step and durable step against what was acknowledged, its
  // weights against the local replay. Returns the steps replayed.
  int64_t CheckLayer(TrainedLayer& layer) {
    v1::LayerInfo info;
    {
      grpc::ClientContext context;
      v1::GetLayerRequest request;
      request.set_name(layer.plan.name);
      v1::GetLayerResponse got;
      EXPECT_TRUE(cluster_->stub()->GetLayer(&context, request, &got).ok());
      info = got.layer();
    }
    const int64_t steps = info.optimizer_step();
    if (std::min(steps, info.durable_optimizer_step()) < layer.acked_durable) {
      figures_.Lost(layer.acked_durable - std::min(steps, info.durable_optimizer_step()));
    }
    EXPECT_GE(steps, layer.acked_durable) << layer.plan.name << ": a durable step was lost";
    EXPECT_GE(info.durable_optimizer_step(), layer.acked_durable) << layer.plan.name;
    EXPECT_TRUE(info.diverged().empty()) << layer.plan.name << ": " << info.diverged();
    grpc::ClientContext context;
    v1::GetWeightsRequest request;
    request.set_layer(layer.plan.name);
    auto reader = cluster_->stub()->GetWeights(&context, request);
    grpc::Status status;
    const std::map<std::string, std::vector<float>> served = ReadChunks(reader.get(), &status);
    EXPECT_TRUE(status.ok()) << status.error_message();
    absl::StatusOr<std::map<std::string, std::vector<float>>> replayed =
        ReplayChaosLayer(layer.plan, kWorkers, steps);
    EXPECT_TRUE(replayed.ok()) << replayed.status();
    if (!replayed.ok()) return steps;
    EXPECT_EQ(served.size(), replayed->size()) << layer.plan.name;
    for (const auto& [name, values] : *replayed) {
      auto it = served.find(name);
      const bool same = it != served.end() && it->second.size() == values.size() &&
                        std::equal(values.begin(), values.end(), it->second.begin(),
                                   [](float a, float b) { return BitEqual(a, b); });
      EXPECT_TRUE(same) << layer.plan.name << "/" << name << " differs from the replay of " << steps
                        << " steps: "
                        << (it == served.end() ? "not served" : Difference(it->second, values));
    }
    return steps;
  }

  // How two tensors differ: how many elements, and the first one.
  static std::string Difference(const std::vector<float>& served,
                                const std::vector<float>& replayed) {
    if (served.size() != replayed.size()) {
      return absl::StrCat(served.size(), " elements served, ", replayed.size(), " replayed");
    }
    size_t count = 0, first = served.size();
    for (size_t i = 0; i < served.size(); ++i) {
      if (BitEqual(served[i], replayed[i])) continue;
      ++count;
      first = std::min(first, i);
    }
    if (count == 0) return "no difference";
    return absl::StrFormat("%zu of %zu elements, the first [%zu] served %.9g, replayed %.9g", count,
                           served.size(), first, served[first], replayed[first]);
  }

  void PrintFigures(int64_t replayed) {
    std::vector<double> sorted;
    std::string kinds;
    for (const auto& [kind, seconds] : recovery_s_) {
      absl::StrAppend(&kinds, kinds.empty() ? "" : ", ", kind, " ", seconds.size(),
                      " (recovered in");
      for (double s : seconds) absl::StrAppend(&kinds, absl::StrFormat(" %.2f", s));
      absl::StrAppend(&kinds, " s)");
      sorted.insert(sorted.end(), seconds.begin(), seconds.end());
    }
    std::sort(sorted.begin(), sorted.end());
    auto percentile = [&](double p) {
      return sorted.empty() ? 0.0 : sorted[std::min(sorted.size() - 1, size_t(p * sorted.size()))];
    };
    std::printf(
        "chaos: seed %u; %d clients, %zu layers; faults injected: %s\n"
        "chaos: calls failed: %s\n"
        "chaos: recovery (fault to the first step acknowledged after it) p50 %.2f s, p99 %.2f s\n"
        "chaos: acknowledged durable steps lost: %lld; steps retrained after a rollback to the "
        "durable step: %lld; steps replayed locally for the check: %lld\n",
        seed_, kClients, layers_.size(), kinds.c_str(), figures_.FailedText().c_str(),
        percentile(0.5), percentile(0.99), static_cast<long long>(figures_.lost()),
        static_cast<long long>(figures_.retrained()), static_cast<long long>(replayed));
  }

  uint32_t seed_ = 0;
  std::string state_dir_;
  std::unique_ptr<TestCluster> cluster_;
  std::vector<std::unique_ptr<TrainedLayer>> layers_;
  Figures figures_;
  std::atomic<bool> driver_done_{false};
  // Seconds from each fault to recovery, by kind: the driver's, read after it joined.
  std::map<std::string, std::vector<double>> recovery_s_;
};

TEST_F(ChaosTest, AcknowledgedDurableStepsSurviveKillsStopsAndRestarts) {
  CreateLayers();
  const absl::Time give_up = absl::Now() + TestBudget();
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c)
    clients.emplace_back([this, c, give_up] { RunClient(c, give_up); });
  std::thread driver([this] { RunDriver(); });
  driver.join();
  for (std::thread& client : clients) client.join();
  ASSERT_TRUE(cluster_->WaitServing(absl::Seconds(30)).ok());
  int64_t replayed = 0;
  for (int i = 0; i < static_cast<int>(layers_.size()); ++i) {
    replayed += CheckLayer(*layers_[i]);
    if (i < kClients) {
      EXPECT_GE(layers_[i]->known_step, kMinSteps) << layers_[i]->plan.name;
    }
  }
  PrintFigures(replayed);
  EXPECT_EQ(figures_.lost(), 0) << "acknowledged durable steps lost";
  for (const std::string& violation : figures_.violations()) ADD_FAILURE() << violation;
}

}  // namespace
}  // namespace moe
