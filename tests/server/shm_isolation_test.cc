// Shared memory between callers (issue 41, items 1 and 2), against moed + 2 real moe-workers
// with --allow_client_shm and two callers' tokens:
// - moed's relay buffers and staged tensors, which hold other callers' tensors, cannot be
//   registered: they have no /dev/shm name (memfds), no link can be made to them, and a link
//   would be refused by the object's identity (PERMISSION_DENIED);
// - one caller's regions are invisible to another: not listed, not usable as x_shm or out_shm,
//   not unregistered (NOT_FOUND as if absent), and nothing of the owner's changes.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/moe_client.h"
#include "client/shared_memory.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using client::SharedMemoryRegion;

constexpr int64_t kTokens = 16, kHidden = 32;
constexpr int64_t kBytes = kTokens * kHidden * 4;

class ShmIsolationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string tokens = ::testing::TempDir() + "/shm_isolation_tokens";
    std::ofstream out(tokens);
    out << Sha256Hex("admin-token") << " admin admin\n"
        << Sha256Hex("alice-token") << " infer alice\n"
        << Sha256Hex("bob-token") << " infer bob\n";
    out.close();
    ClusterOptions options;
    options.workers = 2;
    options.moed_flags = {"--allow_client_shm", "--tokens_file=" + tokens};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
    grpc::ClientContext ctx;
    As(&ctx, "admin-token");
    v1::CreateLayerRequest create;
    create.set_name("iso");
    *create.mutable_config() = TinyConfig(3);
    v1::CreateLayerResponse created;
    grpc::Status s = cluster_->stub()->CreateLayer(&ctx, create, &created);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  static void As(grpc::ClientContext* ctx, const std::string& token) {
    ctx->AddMetadata("authorization", "Bearer " + token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  }
  grpc::Status Register(const std::string& token, const std::string& name, const std::string& key,
                        int64_t byte_size = kBytes) {
    grpc::ClientContext ctx;
    As(&ctx, token);
    v1::RegisterSystemSharedMemoryRequest request;
    request.set_name(name);
    request.set_key(key);
    request.set_byte_size(byte_size);
    v1::RegisterSystemSharedMemoryResponse response;
    return cluster_->stub()->RegisterSystemSharedMemory(&ctx, request, &response);
  }
  grpc::Status Unregister(const std::string& token, const std::string& name) {
    grpc::ClientContext ctx;
    As(&ctx, token);
    v1::UnregisterSystemSharedMemoryRequest request;
    request.set_name(name);
    v1::UnregisterSystemSharedMemoryResponse response;
    return cluster_->stub()->UnregisterSystemSharedMemory(&ctx, request, &response);
  }
  grpc::Status Status(const std::string& token, const std::string& name,
                      v1::SystemSharedMemoryStatusResponse* response) {
    grpc::ClientContext ctx;
    As(&ctx, token);
    v1::SystemSharedMemoryStatusRequest request;
    request.set_name(name);
    return cluster_->stub()->SystemSharedMemoryStatus(&ctx, request, response);
  }
  grpc::Status Forward(const std::string& token, const v1::ForwardRequest& request,
                       v1::ForwardResponse* response) {
    grpc::ClientContext ctx;
    As(&ctx, token);
    return cluster_->stub()->Forward(&ctx, request, response);
  }

  static TestCluster* cluster_;
};
TestCluster* ShmIsolationTest::cluster_ = nullptr;

std::string Key(const std::string& what) { return absl::StrCat("/moed-iso-", getpid(), "-", what); }

v1::ForwardRequest ForwardOver(const std::string& x_region, const std::string& out_region) {
  v1::ForwardRequest request;
  request.set_layer("iso");
  if (x_region.empty()) {
    *request.mutable_x() = FloatsToProto({kTokens, kHidden}, RandomFloats(kTokens * kHidden, 9));
  } else {
    v1::SharedMemoryTensor* x = request.mutable_x_shm();
    x->set_region(x_region);
    x->set_datatype("FP32");
    x->add_shape(kTokens);
    x->add_shape(kHidden);
    x->set_byte_size(kBytes);
  }
  if (!out_region.empty()) {
    request.mutable_out_shm()->set_region(out_region);
    request.mutable_out_shm()->set_byte_size(kBytes);
  }
  return request;
}

// Names in /dev/shm starting with `prefix`.
std::vector<std::string> ShmNames(const std::string& prefix) {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (const dirent* entry = readdir(dir)) {
    if (absl::StartsWith(entry->d_name, prefix)) names.push_back(entry->d_name);
  }
  closedir(dir);
  return names;
}

// moed's descriptors of its relay buffers: "/proc/<moed>/fd/<n>".
std::vector<std::string> RelayDescriptors(pid_t moed) {
  std::vector<std::string> paths;
  const std::string dir_path = absl::StrCat("/proc/", moed, "/fd");
  DIR* dir = opendir(dir_path.c_str());
  if (dir == nullptr) return paths;
  while (const dirent* entry = readdir(dir)) {
    const std::string path = dir_path + "/" + entry->d_name;
    char target[512];
    const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (absl::StrContains(target, "moed-relay-")) paths.push_back(path);
  }
  closedir(dir);
  return paths;
}

bool WorkerMapsRelay(pid_t worker, pid_t moed) {
  std::ifstream in(absl::StrCat("/proc/", worker, "/maps"));
  std::string maps((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return maps.find(absl::StrCat("moed-relay-", moed, "-")) != std::string::npos;
}

TEST_F(ShmIsolationTest, RelayBuffersAndStagedTensorsCannotBeRegistered) {
  const pid_t moed = cluster_->moed_pid();
  // A gRPC forward through the relay, and a staged one (the client's lanes stage x).
  v1::ForwardResponse answer;
  ASSERT_TRUE(Forward("alice-token", ForwardOver("", ""), &answer).ok());
  client::ClientOptions lanes;
  lanes.token = "alice-token";
  lanes.lanes = 4;
  lanes.lane_min_bytes = 0;
  lanes.default_deadline = absl::Seconds(30);
  auto staged = client::MoeClient::Connect(cluster_->address(), lanes);
  ASSERT_TRUE(staged.ok()) << staged.status();
  Tensor x = Tensor::FromFloats({kTokens, kHidden}, RandomFloats(kTokens * kHidden, 4));
  ASSERT_TRUE((*staged)->Forward("iso", x, /*keep_for_backward=*/false).ok());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(WorkerMapsRelay(cluster_->worker_pid(r), moed)) << "worker " << r;
  }

  // By name: nothing in /dev/shm; the names moed used to give them are not found.
  EXPECT_TRUE(ShmNames(absl::StrCat("moed-relay-", moed, "-")).empty());
  for (int n = 0; n < 4; ++n) {
    grpc::Status s = Register("bob-token", "steal", absl::StrCat("/moed-relay-", moed, "-", n));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << n << ": " << s.error_message();
  }
  // By any other path: a hard link to moed's descriptor cannot be made (the object has no link
  // to copy); a symlink is not followed; and if a link were made, the object is refused by
  // what it is.
  const std::vector<std::string> descriptors = RelayDescriptors(moed);
  ASSERT_FALSE(descriptors.empty());
  for (const std::string& path : descriptors) {
    SCOPED_TRACE(path);
    const std::string alias = absl::StrCat("moed-iso-", getpid(), "-alias");
    const std::string alias_path = "/dev/shm/" + alias;
    if (linkat(AT_FDCWD, path.c_str(), AT_FDCWD, alias_path.c_str(), AT_SYMLINK_FOLLOW) == 0) {
      grpc::Status s = Register("bob-token", "steal", "/" + alias);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
      unlink(alias_path.c_str());
    }
    ASSERT_EQ(symlink(path.c_str(), alias_path.c_str()), 0) << std::strerror(errno);
    EXPECT_FALSE(Register("bob-token", "steal", "/" + alias).ok());
    unlink(alias_path.c_str());
  }
  v1::SystemSharedMemoryStatusResponse status;
  ASSERT_TRUE(Status("bob-token", "", &status).ok());
  EXPECT_EQ(status.regions_size(), 0);
  // Steps still go through the relay afterwards.
  ASSERT_TRUE(Forward("alice-token", ForwardOver("", ""), &answer).ok());
  EXPECT_EQ(answer.out().raw_data().size(), static_cast<size_t>(kBytes));
}

TEST_F(ShmIsolationTest, OneCallersRegionsAreAbsentForAnother) {
  auto x_shm = SharedMemoryRegion::Create(Key("x"), kBytes);
  auto out_shm = SharedMemoryRegion::Create(Key("out"), kBytes);
  ASSERT_TRUE(x_shm.ok() && out_shm.ok());
  const std::vector<float> x = RandomFloats(kTokens * kHidden, 17);
  std::memcpy((*x_shm)->data(), x.data(), kBytes);
  std::memset((*out_shm)->data(), 0x5a, kBytes);
  ASSERT_TRUE(Register("alice-token", "in", Key("x")).ok());
  ASSERT_TRUE(Register("alice-token", "out", Key("out")).ok());

  // Bob sees nothing of Alice's: not listed, not by name.
  v1::SystemSharedMemoryStatusResponse status;
  ASSERT_TRUE(Status("bob-token", "", &status).ok());
  EXPECT_EQ(status.regions_size(), 0);
  EXPECT_EQ(Status("bob-token", "in", &status).error_code(), grpc::StatusCode::NOT_FOUND);
  // Not usable: as input, or as where his output goes.
  v1::ForwardResponse answer;
  grpc::Status s = Forward("bob-token", ForwardOver("in", ""), &answer);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  s = Forward("bob-token", ForwardOver("", "out"), &answer);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(std::string(static_cast<const char*>((*out_shm)->data()), kBytes),
            std::string(kBytes, '\x5a'));  // nothing written into Alice's region
  // Not unregistered, one by one or all at once.
  EXPECT_EQ(Unregister("bob-token", "in").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(Unregister("bob-token", "").ok());  // all of Bob's: none
  // His own region may have the same name.
  auto bob_shm = SharedMemoryRegion::Create(Key("bob"), 2 * kBytes);
  ASSERT_TRUE(bob_shm.ok());
  ASSERT_TRUE(Register("bob-token", "in", Key("bob"), 2 * kBytes).ok());
  ASSERT_TRUE(Status("bob-token", "", &status).ok());
  ASSERT_EQ(status.regions_size(), 1);
  EXPECT_EQ(status.regions(0).key(), Key("bob"));

  // Alice's regions are as she left them, and serve her step.
  status.Clear();
  ASSERT_TRUE(Status("alice-token", "", &status).ok());
  ASSERT_EQ(status.regions_size(), 2);
  EXPECT_EQ(status.regions(0).name(), "in");
  EXPECT_EQ(status.regions(0).key(), Key("x"));
  EXPECT_EQ(status.regions(0).byte_size(), kBytes);
  EXPECT_EQ(status.regions(1).name(), "out");
  s = Forward("alice-token", ForwardOver("in", "out"), &answer);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::ForwardResponse over_grpc;
  v1::ForwardRequest same = ForwardOver("", "");
  *same.mutable_x() = FloatsToProto({kTokens, kHidden}, x);
  ASSERT_TRUE(Forward("alice-token", same, &over_grpc).ok());
  EXPECT_TRUE(std::string(static_cast<const char*>((*out_shm)->data()), kBytes) ==
              over_grpc.out().raw_data());
  ASSERT_TRUE(Unregister("alice-token", "").ok());
  ASSERT_TRUE(Unregister("bob-token", "").ok());
}

}  // namespace
}  // namespace moe
