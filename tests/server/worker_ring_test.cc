// moed -> worker step rings (server/worker_rings.h, --worker_ring): the same answers bit for
// bit as over gRPC (forward, backward, several layers at once, tensors inline in the records
// or relayed through shared memory); a worker killed mid-step on the ring path gives the
// caller UNAVAILABLE before the step timeout and the cluster recovers; a region made by
// another process than moed is refused by the worker (pid check), and no ring's name is left
// in /dev/shm once the channels are up.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"
#include "server/cluster_secret.h"
#include "server/pid_namespace.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"
#include "transport/ring_channel.h"

namespace moe {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

// moed with `flags` and 2 workers; null (with the test failed) when it did not start.
std::unique_ptr<TestCluster> StartCluster(std::vector<std::string> flags) {
  ClusterOptions options;
  options.moed_flags = std::move(flags);
  absl::StatusOr<std::unique_ptr<TestCluster>> started = TestCluster::Start(options);
  if (started.ok()) return *std::move(started);
  ADD_FAILURE() << "the cluster did not start: " << started.status();
  return nullptr;
}

grpc::Status Create(TestCluster* cluster, const std::string& name, uint64_t seed) {
  grpc::ClientContext ctx;
  v1::CreateLayerRequest request;
  request.set_name(name);
  *request.mutable_config() = TinyConfig(seed);
  v1::CreateLayerResponse response;
  return cluster->stub()->CreateLayer(&ctx, request, &response);
}

// Forward (kept) + Backward of `tokens` tokens on `layer`: every answer's bytes, in order.
std::vector<std::string> Step(TestCluster* cluster, const std::string& layer, int64_t tokens,
                              uint32_t seed) {
  std::vector<std::string> bytes;
  grpc::ClientContext fwd_ctx;
  fwd_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  v1::ForwardRequest fwd;
  fwd.set_layer(layer);
  *fwd.mutable_x() = FloatsToProto({tokens, 32}, RandomFloats(tokens * 32, seed));
  fwd.set_keep_for_backward(true);
  v1::ForwardResponse out;
  grpc::Status s = cluster->stub()->Forward(&fwd_ctx, fwd, &out);
  EXPECT_TRUE(s.ok()) << layer << " " << tokens << ": " << s.error_message();
  if (!s.ok()) return bytes;
  bytes.push_back(out.out().raw_data());
  bytes.push_back(absl::StrCat(out.aux_loss(), " ", out.z_loss()));
  for (int64_t c : out.tokens_per_expert()) bytes.push_back(absl::StrCat(c));
  grpc::ClientContext bwd_ctx;
  bwd_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  v1::BackwardRequest bwd;
  bwd.set_layer(layer);
  bwd.set_step_id(out.step_id());
  *bwd.mutable_d_out() = FloatsToProto({tokens, 32}, RandomFloats(tokens * 32, seed + 1));
  bwd.set_d_aux(1.0f);
  bwd.set_d_z_loss(1.0f);
  v1::BackwardResponse d_x;
  s = cluster->stub()->Backward(&bwd_ctx, bwd, &d_x);
  EXPECT_TRUE(s.ok()) << layer << " " << tokens << ": " << s.error_message();
  bytes.push_back(d_x.d_x().raw_data());
  return bytes;
}

// Three layers stepping at once (each thread its own layer), then a gradient of each.
std::map<std::string, std::vector<std::string>> Workload(TestCluster* cluster) {
  const std::vector<std::string> layers = {"a", "b", "c"};
  std::map<std::string, std::vector<std::string>> answers;
  for (size_t i = 0; i < layers.size(); ++i) {
    EXPECT_TRUE(Create(cluster, layers[i], 40 + i).ok());
    answers[layers[i]];
  }
  std::vector<std::thread> threads;
  for (size_t i = 0; i < layers.size(); ++i) {
    std::vector<std::string>* mine_ptr = &answers[layers[i]];
    threads.emplace_back([&, i, mine_ptr] {
      std::vector<std::string>& mine = *mine_ptr;
      for (int64_t tokens : {16, 5, 300, 1}) {
        for (std::string& b : Step(cluster, layers[i], tokens, 7 * i + tokens)) {
          mine.push_back(std::move(b));
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& layer : layers) {
    grpc::ClientContext ctx;
    v1::GetGradientsRequest request;
    request.set_layer(layer);
    auto reader = cluster->stub()->GetGradients(&ctx, request);
    v1::TensorChunk chunk;
    while (reader->Read(&chunk)) answers[layer].push_back(chunk.name() + chunk.raw_data());
    EXPECT_TRUE(reader->Finish().ok());
  }
  return answers;
}

// The worker's mappings of step rings: "/dev/shm/moed-worker-ring-... (deleted)" lines of its maps.
std::vector<std::string> RingMappings(pid_t pid) {
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  std::vector<std::string> found;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("moed-worker-ring-") != std::string::npos) found.push_back(line);
  }
  return found;
}

// The names of `pid`'s ring mappings that still exist in /dev/shm (other processes' rings
// are not looked at: other tests may run beside this one).
std::vector<std::string> RingNamesLeft(pid_t pid) {
  std::vector<std::string> left;
  for (const std::string& line : RingMappings(pid)) {
    const size_t begin = line.find("/dev/shm/");
    if (begin == std::string::npos) continue;
    const std::string path = line.substr(begin, line.find(' ', begin) - begin);
    if (std::filesystem::exists(path)) left.push_back(path);
  }
  return left;
}

TEST(WorkerRingTest, AnswersAreBitIdenticalWithTheRingOnAndOff) {
  std::map<std::string, std::vector<std::string>> grpc_answers, ring_answers, inline_answers;
  {
    auto cluster = StartCluster({"--worker_ring=false"});
    ASSERT_NE(cluster, nullptr);
    EXPECT_THAT(RingMappings(cluster->worker_pid(0)), IsEmpty());
    grpc_answers = Workload(cluster.get());
  }
  {
    auto cluster = StartCluster({"--worker_ring=true"});
    ASSERT_NE(cluster, nullptr);
    // Every worker maps its channels, none of which has a name any more.
    for (int r = 0; r < 2; ++r) {
      const std::vector<std::string> mapped = RingMappings(cluster->worker_pid(r));
      EXPECT_EQ(mapped.size(), 4u) << "rank " << r;
      for (const std::string& line : mapped) EXPECT_THAT(line, HasSubstr("(deleted)"));
      EXPECT_THAT(RingNamesLeft(cluster->worker_pid(r)), IsEmpty());
    }
    ring_answers = Workload(cluster.get());
  }
  {
    // Without the relay the tensors travel inside the ring records themselves.
    auto cluster = StartCluster({"--worker_ring=true", "--shm_relay=false"});
    ASSERT_NE(cluster, nullptr);
    inline_answers = Workload(cluster.get());
  }
  for (const auto& [layer, answers] : grpc_answers) {
    ASSERT_GT(answers.size(), 10u) << layer;
    EXPECT_TRUE(answers == ring_answers[layer]) << layer << ": the ring changed an answer";
    EXPECT_TRUE(answers == inline_answers[layer]) << layer << ": inline records changed one";
  }
}

TEST(WorkerRingTest, WorkerKilledMidStepFailsTheCallerAndTheClusterRecovers) {
  auto cluster = StartCluster({"--worker_ring=true"});
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(Create(cluster.get(), "k", 3).ok());
  const std::vector<std::string> before = Step(cluster.get(), "k", 64, 9);
  ASSERT_FALSE(before.empty());

  // Steps large enough to be running when the worker dies; the kill lands mid-step.
  std::atomic<bool> stop{false};
  std::atomic<int> unavailable{0}, other{0};
  std::string other_error;
  std::thread client([&] {
    while (!stop) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
      v1::ForwardRequest fwd;
      fwd.set_layer("k");
      *fwd.mutable_x() = FloatsToProto({4096, 32}, RandomFloats(4096 * 32, 1));
      v1::ForwardResponse out;
      const grpc::Status s = cluster->stub()->Forward(&ctx, fwd, &out);
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
        ++unavailable;
        stop = true;
      } else if (!s.ok()) {
        ++other;
        other_error = s.error_message();
        stop = true;
      }
    }
  });
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL));
  client.join();
  // The ring reports the dead worker as gRPC does (UNAVAILABLE), not by the step timeout's
  // DEADLINE_EXCEEDED (--step_timeout_ms is 30 s, the client's deadline 60 s).
  EXPECT_EQ(unavailable, 1);
  EXPECT_EQ(other, 0) << other_error;

  ASSERT_TRUE(cluster->RestartWorker(1).ok());
  ASSERT_TRUE(cluster->WaitServing(absl::Seconds(60)).ok());
  // New channels for the new generation (the replaced worker maps its own), same answers:
  // the layer is back at init_seed, as before it trained nothing.
  EXPECT_EQ(RingMappings(cluster->worker_pid(1)).size(), 4u);
  EXPECT_TRUE(Step(cluster.get(), "k", 64, 9) == before);
}

// A caller with the cluster secret but not moed: its region's caller slot holds its own pid.
TEST(WorkerRingTest, RegionOfAnotherProcessThanMoedIsRefused) {
  auto cluster = StartCluster({"--worker_ring=true"});
  ASSERT_NE(cluster, nullptr);
  grpc::ClientContext status_ctx;
  v1::GetStatusResponse status;
  ASSERT_TRUE(cluster->stub()->GetStatus(&status_ctx, v1::GetStatusRequest(), &status).ok());
  absl::StatusOr<ClusterSecret> secret = ClusterSecret::FromString(cluster->cluster_secret());
  ASSERT_TRUE(secret.ok()) << secret.status();
  auto worker = internal::Worker::NewStub(
      secret->Channel(status.workers(0).address(), grpc::ChannelArguments()));

  const uint64_t ring_bytes = 1 << 16;
  const std::string forged = absl::StrCat("/moed-worker-ring-forged-", getpid());
  absl::StatusOr<ShmObject> object =
      ShmObject::CreateNamed(forged, RingChannel::RegionBytes(ring_bytes));
  ASSERT_TRUE(object.ok()) << object.status();
  RingChannelOptions options;
  options.ring_bytes = ring_bytes;
  absl::StatusOr<std::unique_ptr<RingChannel>> channel =
      RingChannel::Create(*std::move(object), RingChannel::Role::kCaller, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  // And a region of garbage bytes with a ring's name.
  const std::string garbage = absl::StrCat("/moed-worker-ring-garbage-", getpid());
  absl::StatusOr<ShmObject> junk = ShmObject::CreateNamed(garbage, 1 << 16);
  ASSERT_TRUE(junk.ok());
  {
    absl::StatusOr<ShmMapping> view = junk->Map();
    ASSERT_TRUE(view.ok());
    for (size_t i = 0; i < view->size(); ++i) view->data()[i] = static_cast<char>(i * 131 + 7);
  }

  internal::OpenStepChannelsRequest request;
  request.set_generation(status.generation());
  request.set_caller_pid(cluster->moed_pid());  // claims to be moed
  request.set_caller_pid_namespace(PidNamespace());
  request.add_names(forged);
  request.add_names(garbage);
  request.add_names("/not-a-ring");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  internal::OpenStepChannelsResponse response;
  ASSERT_TRUE(worker->OpenStepChannels(&ctx, request, &response).ok());
  ASSERT_EQ(response.errors_size(), 3);
  EXPECT_THAT(response.errors(0), HasSubstr("caller slot holds pid"));
  EXPECT_THAT(response.errors(1), HasSubstr("not a ring channel"));
  EXPECT_THAT(response.errors(2), HasSubstr("not a step ring name"));
  // The forged channel has no server: a call on it is never answered.
  absl::StatusOr<std::string> answer =
      (*channel)->Call(std::string(16, 'x'), absl::Now() + absl::Milliseconds(200));
  EXPECT_FALSE(answer.ok());

  // The worker still serves moed's own channels: steps go on.
  ASSERT_TRUE(Create(cluster.get(), "f", 5).ok());
  EXPECT_FALSE(Step(cluster.get(), "f", 16, 2).empty());
  EXPECT_EQ(RingMappings(cluster->worker_pid(0)).size(), 4u);
}

}  // namespace
}  // namespace moe
