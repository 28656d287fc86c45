// moed's relay to local workers (server/relay_pool.h) through a real cluster: a gRPC step's
// tensors go to the workers through moed's relay buffers (memfds "moed-relay-*" the workers
// map), the answers are bit-identical to a moed started with --shm_relay=false, and neither a
// running nor a killed moed leaves anything in /dev/shm. Staged tensors (StageTensor /
// FetchStaged): the C++ client's steps over several connections give the one-call answer, and fall
// back to it on a moed that refuses them.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/moe_client.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

// /dev/shm objects moed `pid` created for its relay.
std::vector<std::string> RelayObjects(pid_t pid) {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  const std::string prefix = absl::StrCat("moed-relay-", pid, "-");
  while (const dirent* entry = readdir(dir)) {
    if (absl::StartsWith(entry->d_name, prefix)) names.push_back(entry->d_name);
  }
  closedir(dir);
  return names;
}

bool MapsRelay(pid_t worker, pid_t moed) {
  std::ifstream in(absl::StrCat("/proc/", worker, "/maps"));
  std::string maps((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return maps.find(absl::StrCat("/memfd:moed-relay-", moed, "-")) != std::string::npos;
}

// Inodes of the relay buffers moed `moed` holds open now.
std::set<std::string> HeldRelayInodes(pid_t moed) {
  std::set<std::string> inodes;
  const std::string dir_path = absl::StrCat("/proc/", moed, "/fd");
  DIR* dir = opendir(dir_path.c_str());
  if (dir == nullptr) return inodes;
  while (const dirent* entry = readdir(dir)) {
    const std::string path = dir_path + "/" + entry->d_name;
    char target[512];
    const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    struct stat st;
    if (n <= 0 || stat(path.c_str(), &st) != 0) continue;
    target[n] = '\0';
    if (absl::StrContains(target, "moed-relay-")) inodes.insert(absl::StrCat(st.st_ino));
  }
  closedir(dir);
  return inodes;
}

// Relay buffers of moed `moed` that `worker` still maps after moed closed them.
int MappedDeletedRelays(pid_t worker, pid_t moed) {
  const std::set<std::string> held = HeldRelayInodes(moed);
  std::ifstream in(absl::StrCat("/proc/", worker, "/maps"));
  const std::string name = absl::StrCat("/memfd:moed-relay-", moed, "-");
  std::set<std::string> stale;
  for (std::string line; std::getline(in, line);) {
    if (line.find(name) == std::string::npos) continue;
    // "start-end perms offset dev inode path": the fifth field.
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() > 4 && held.count(fields[4]) == 0) stale.insert(fields[4]);
  }
  return static_cast<int>(stale.size());
}

std::unique_ptr<TestCluster> StartCluster(std::vector<std::string> flags) {
  ClusterOptions options;
  options.workers = 2;
  options.moed_flags = std::move(flags);
  auto cluster = TestCluster::Start(options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? *std::move(cluster) : nullptr;
}

struct StepAnswers {
  v1::ForwardResponse forward;
  v1::BackwardResponse backward;
};

// Creates layer "relay" (TinyConfig(7)) and runs one Forward + Backward of x and d_out.
StepAnswers RunStep(TestCluster& cluster, const v1::Tensor& x, const v1::Tensor& d_out) {
  StepAnswers answers;
  auto deadline = [] { return std::chrono::system_clock::now() + std::chrono::seconds(30); };
  grpc::ClientContext create_ctx;
  create_ctx.set_deadline(deadline());
  v1::CreateLayerRequest create;
  create.set_name("relay");
  *create.mutable_config() = TinyConfig(7);
  v1::CreateLayerResponse created;
  grpc::Status s = cluster.stub()->CreateLayer(&create_ctx, create, &created);
  EXPECT_TRUE(s.ok() || s.error_code() == grpc::StatusCode::ALREADY_EXISTS) << s.error_message();

  grpc::ClientContext fctx;
  fctx.set_deadline(deadline());
  v1::ForwardRequest forward;
  forward.set_layer("relay");
  *forward.mutable_x() = x;
  forward.set_keep_for_backward(true);
  s = cluster.stub()->Forward(&fctx, forward, &answers.forward);
  EXPECT_TRUE(s.ok()) << s.error_message();

  grpc::ClientContext bctx;
  bctx.set_deadline(deadline());
  v1::BackwardRequest backward;
  backward.set_layer("relay");
  backward.set_step_id(answers.forward.step_id());
  *backward.mutable_d_out() = d_out;
  s = cluster.stub()->Backward(&bctx, backward, &answers.backward);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return answers;
}

v1::Tensor ToBf16(const v1::Tensor& t) {
  v1::Tensor out;
  TensorToProto(TensorFromProto("t", t)->ConvertTo(DType::kBFloat16), &out);
  return out;
}

// Forward + Backward of x through `client` on layer "relay" (created by RunStep).
struct ClientStep {
  Tensor out, d_x;
};
ClientStep RunClientStep(client::MoeClient& client, const Tensor& x) {
  ClientStep step;
  auto fwd = client.Forward("relay", x, /*keep_for_backward=*/true);
  EXPECT_TRUE(fwd.ok()) << fwd.status();
  if (!fwd.ok()) return step;
  step.out = std::move(fwd->out);
  auto d_x = client.Backward("relay", fwd->step_id, x);  // d_out = x: any tensor will do
  EXPECT_TRUE(d_x.ok()) << d_x.status();
  if (d_x.ok()) step.d_x = *std::move(d_x);
  return step;
}

std::string Bytes(const Tensor& t) {
  return std::string(static_cast<const char*>(t.raw()), t.num_bytes());
}

// The C++ client over 4 lanes (every tensor staged) answers as over one call; against a moed
// without the relay it falls back to the one call. Bad staged names are refused.
void CheckStagedSteps(TestCluster& relayed, TestCluster& plain) {
  client::ClientOptions lanes;
  lanes.lanes = 4;
  lanes.lane_min_bytes = 0;
  client::ClientOptions one = lanes;
  one.lanes = 1;
  auto staged = client::MoeClient::Connect(relayed.address(), lanes);
  auto direct = client::MoeClient::Connect(relayed.address(), one);
  auto fallback = client::MoeClient::Connect(plain.address(), lanes);
  ASSERT_TRUE(staged.ok() && direct.ok() && fallback.ok());
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Tensor x = Tensor::FromFloats({37, 32}, RandomFloats(37 * 32, 21)).ConvertTo(dtype);
    const ClientStep a = RunClientStep(**staged, x);
    const ClientStep b = RunClientStep(**direct, x);
    const ClientStep c = RunClientStep(**fallback, x);
    EXPECT_EQ(a.out.dtype(), dtype);
    EXPECT_EQ(a.out.shape(), x.shape());
    EXPECT_EQ(a.d_x.num_bytes(), x.num_bytes());
    EXPECT_TRUE(Bytes(a.out) == Bytes(b.out));
    EXPECT_TRUE(Bytes(a.d_x) == Bytes(b.d_x));
    EXPECT_TRUE(Bytes(a.out) == Bytes(c.out));
    EXPECT_TRUE(Bytes(a.d_x) == Bytes(c.d_x));
  }
  auto call = [&](v1::ForwardRequest request) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ForwardResponse response;
    return relayed.stub()->Forward(&ctx, request, &response).error_code();
  };
  v1::ForwardRequest request;
  request.set_layer("relay");
  request.set_x_staged("never-staged");
  EXPECT_EQ(call(request), grpc::StatusCode::NOT_FOUND);
  *request.mutable_x() = FloatsToProto({2, 32}, RandomFloats(64, 3));
  request.set_out_staged("not a name");
  EXPECT_EQ(call(request), grpc::StatusCode::INVALID_ARGUMENT);
  // Fetching what was never kept, or another caller's name: NOT_FOUND.
  grpc::ClientContext ctx;
  v1::FetchStagedRequest fetch;
  fetch.set_name("nothing");
  fetch.set_rows(1);
  v1::FetchStagedResponse fetched;
  EXPECT_EQ(relayed.stub()->FetchStaged(&ctx, fetch, &fetched).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST(RelayTest, LocalWorkersUseTheRelayAndAnswerAsOverGrpc) {
  std::unique_ptr<TestCluster> relayed = StartCluster({});
  std::unique_ptr<TestCluster> plain = StartCluster({"--shm_relay=false"});
  ASSERT_NE(relayed, nullptr);
  ASSERT_NE(plain, nullptr);
  const int64_t tokens = 37, hidden = 32;
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "BF16" : "FP32");
    v1::Tensor x = FloatsToProto({tokens, hidden}, RandomFloats(tokens * hidden, 11));
    v1::Tensor d_out = FloatsToProto({tokens, hidden}, RandomFloats(tokens * hidden, 12));
    if (bf16) {
      x = ToBf16(x);
      d_out = ToBf16(d_out);
    }
    const StepAnswers a = RunStep(*relayed, x, d_out);
    const StepAnswers b = RunStep(*plain, x, d_out);
    ASSERT_EQ(a.forward.out().raw_data().size(), x.raw_data().size());
    EXPECT_EQ(a.forward.out().datatype(), x.datatype());
    EXPECT_TRUE(a.forward.out().raw_data() == b.forward.out().raw_data());
    EXPECT_EQ(a.forward.aux_loss(), b.forward.aux_loss());
    EXPECT_EQ(a.forward.z_loss(), b.forward.z_loss());
    ASSERT_EQ(a.backward.d_x().raw_data().size(), x.raw_data().size());
    EXPECT_TRUE(a.backward.d_x().raw_data() == b.backward.d_x().raw_data());
  }
  CheckStagedSteps(*relayed, *plain);
  // The relayed cluster's workers read and wrote moed's buffers; the other moed made none.
  // Neither has a name in /dev/shm (memfds: no client can open them).
  EXPECT_FALSE(HeldRelayInodes(relayed->moed_pid()).empty());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(MapsRelay(relayed->worker_pid(r), relayed->moed_pid())) << "worker " << r;
  }
  EXPECT_TRUE(RelayObjects(relayed->moed_pid()).empty());
  EXPECT_TRUE(HeldRelayInodes(plain->moed_pid()).empty());

  // A killed moed leaves nothing behind.
  const pid_t killed = relayed->moed_pid();
  relayed->SignalMoed(SIGKILL);
  relayed.reset();
  EXPECT_TRUE(RelayObjects(killed).empty());
}

// A relay buffer the pool evicts (here: a 2 MiB pool, a step of 1 MiB buffers, then one that
// needs 2 MiB) is closed by moed and, within a housekeeping round, unmapped by the workers,
// instead of staying mapped (its memory held) until their idle unmap a minute later.
TEST(RelayTest, WorkersUnmapEvictedRelayBuffers) {
  std::unique_ptr<TestCluster> cluster = StartCluster({"--shm_relay_max_bytes=2097152"});
  ASSERT_NE(cluster, nullptr);
  const int64_t hidden = 32;
  for (int64_t tokens : {4000, 12000}) {  // fp32 rows: ~0.5 MiB, then ~1.5 MiB
    v1::Tensor x = FloatsToProto({tokens, hidden}, RandomFloats(tokens * hidden, 31));
    const StepAnswers a = RunStep(*cluster, x, x);
    ASSERT_EQ(a.forward.out().raw_data().size(), x.raw_data().size());
    ASSERT_EQ(a.backward.d_x().raw_data().size(), x.raw_data().size());
    if (tokens == 4000) {
      for (int r = 0; r < 2; ++r) EXPECT_TRUE(MapsRelay(cluster->worker_pid(r), cluster->moed_pid()));
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int left = 0;
  do {
    left = 0;
    for (int r = 0; r < 2; ++r) left += MappedDeletedRelays(cluster->worker_pid(r), cluster->moed_pid());
    if (left == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  } while (std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(left, 0) << "workers still map evicted relay buffers";
  // The pool's current buffer is still mapped (the evicted ones were the 1 MiB ones).
  EXPECT_TRUE(MapsRelay(cluster->worker_pid(0), cluster->moed_pid()));
}

}  // namespace
}  // namespace moe
