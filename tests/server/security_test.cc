// The attacks of the security probe (issue 13), each as a request against a real cluster:
// checkpoint paths that reach outside --checkpoint_root, symbolic links, replacing what moed
// did not write, the LoadCheckpoint existence oracle, a second moed on a taken port, and the
// loopback default. Every refusal checks the code, that the filesystem is untouched, and
// that the service still answers.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster_fixture.h"
#include "tests/server/fs_snapshot.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

class SecurityTest : public ClusterTest {
 protected:
  grpc::Status Save(const std::string& layer, const std::string& dir) {
    grpc::ClientContext ctx;
    v1::SaveCheckpointRequest request;
    request.set_layer(layer);
    request.set_directory(dir);
    v1::SaveCheckpointResponse response;
    return stub()->SaveCheckpoint(&ctx, request, &response);
  }
  grpc::Status Load(const std::string& layer, const std::string& dir) {
    grpc::ClientContext ctx;
    v1::LoadCheckpointRequest request;
    request.set_layer(layer);
    request.set_directory(dir);
    v1::LoadCheckpointResponse response;
    return stub()->LoadCheckpoint(&ctx, request, &response);
  }
  // A sandbox standing in for the host: a folder with files, a copy of a password file, a
  // symbolic link to the folder.
  fs::path MakeSandbox(const std::string& name) {
    const fs::path sandbox = fs::path(::testing::TempDir()) / name;
    fs::remove_all(sandbox);
    fs::create_directories(sandbox / "data");
    std::ofstream(sandbox / "data" / "important.txt") << "keep me";
    std::ofstream(sandbox / "passwd") << "root:x:0:0:root:/root:/bin/bash\n";
    fs::create_directory_symlink(sandbox / "data", sandbox / "link");
    return sandbox;
  }
};

TEST_F(SecurityTest, CheckpointPathsOutsideTheRootAreRefusedAndTouchNothing) {
  ASSERT_TRUE(Create("sec", TinyConfig(1)).ok());
  const fs::path sandbox = MakeSandbox("sandbox_abs");
  const auto before = SnapshotTree(sandbox);
  struct stat null_before;
  ASSERT_EQ(::stat("/dev/null", &null_before), 0);
  // The probe's targets: a folder with files, a password file, a symlink, deep new parents,
  // /dev/null itself, and the root's own parent by "..".
  for (const std::string& dir :
       {(sandbox / "data").string(), (sandbox / "passwd").string(), (sandbox / "link").string(),
        (sandbox / "new" / "deep" / "parents").string(), std::string("/dev/null"),
        std::string("../escaped"), std::string("a/../../escaped")}) {
    grpc::Status s = Save("sec", dir);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << dir << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("checkpoint_root")) << dir;
    s = Load("sec", dir);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << dir;
  }
  EXPECT_EQ(SnapshotTree(sandbox), before);
  EXPECT_FALSE(fs::exists(sandbox / "new"));
  EXPECT_FALSE(fs::exists(fs::path(cluster_->checkpoint_root()).parent_path() / "escaped"));
  struct stat null_after;
  ASSERT_EQ(::stat("/dev/null", &null_after), 0);
  EXPECT_TRUE(S_ISCHR(null_after.st_mode));
  EXPECT_EQ(null_after.st_rdev, null_before.st_rdev);
  EXPECT_EQ(*cluster_->Health(), "SERVING");
}

TEST_F(SecurityTest, NoExistenceOracleOutsideTheRoot) {
  ASSERT_TRUE(Create("oracle", TinyConfig(2)).ok());
  const fs::path sandbox = MakeSandbox("sandbox_oracle");
  // An existing and a missing path outside the root get the same answer.
  grpc::Status existing = Load("oracle", (sandbox / "data").string());
  grpc::Status missing = Load("oracle", (sandbox / "no-such-thing").string());
  EXPECT_EQ(existing.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(missing.error_code(), existing.error_code());
  EXPECT_THAT(existing.error_message(), Not(HasSubstr("No such file")));
  EXPECT_THAT(existing.error_message(), Not(HasSubstr("exists")));
}

TEST_F(SecurityTest, LinksInsideTheRootAreNotFollowed) {
  ASSERT_TRUE(Create("links", TinyConfig(3)).ok());
  const fs::path sandbox = MakeSandbox("sandbox_links");
  const fs::path root = cluster_->checkpoint_root();
  fs::create_directory_symlink(sandbox / "data", root / "to-data");
  fs::create_directory_symlink(sandbox, root / "to-sandbox");
  const auto before = SnapshotTree(sandbox);
  for (const char* dir : {"to-data", "to-sandbox/data", "to-sandbox/fresh"}) {
    grpc::Status s = Save("links", dir);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << dir << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("symbolic link")) << dir;
    EXPECT_EQ(Load("links", dir).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << dir;
  }
  EXPECT_EQ(SnapshotTree(sandbox), before);
  EXPECT_EQ(fs::read_symlink(root / "to-data"), sandbox / "data");
  EXPECT_EQ(*cluster_->Health(), "SERVING");
}

TEST_F(SecurityTest, OnlyCheckpointsMoedWroteAreReplaced) {
  ASSERT_TRUE(Create("own", TinyConfig(4)).ok());
  const fs::path root = cluster_->checkpoint_root();
  fs::create_directories(root / "mine");
  std::ofstream(root / "mine" / "notes.txt") << "not a checkpoint";
  std::ofstream(root / "plain-file") << "a file";
  const auto before = SnapshotTree(root / "mine");
  for (const char* dir : {"mine", "plain-file"}) {
    grpc::Status s = Save("own", dir);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << dir << ": " << s.error_message();
    EXPECT_EQ(Load("own", dir).error_code(), grpc::StatusCode::FAILED_PRECONDITION) << dir;
  }
  EXPECT_EQ(SnapshotTree(root / "mine"), before);
  // A checkpoint moed wrote is replaced; a missing one is NOT_FOUND.
  ASSERT_TRUE(Save("own", "own/ckpt").ok());
  ASSERT_TRUE(Save("own", "own/ckpt").ok());
  ASSERT_TRUE(Load("own", "own/ckpt").ok());
  EXPECT_EQ(Load("own", "own/none").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(*cluster_->Health(), "SERVING");
}

// A second moed on a port the first holds must fail at start (no SO_REUSEPORT).
TEST_F(SecurityTest, ASecondMoedOnATakenPortFailsToStart) {
  const std::string address = cluster_->address();
  const std::string port = address.substr(address.rfind(':') + 1);
  const std::string log = ::testing::TempDir() + "/second_moed.log";
  const std::string command =
      absl::StrCat("timeout 20 ", RunfilePath("server/moed"), " --listen=127.0.0.1 --port=", port,
                   " --expect_workers=1 --cluster_secret_file=", TestClusterSecretFile(),
                   " --checkpoint_root=", ::testing::TempDir(), "/second_root 2>", log);
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1) << "a second moed started on a taken port";
  std::ifstream in(log);
  EXPECT_THAT(std::string(std::istreambuf_iterator<char>(in), {}), HasSubstr("cannot listen"));
  EXPECT_EQ(*cluster_->Health(), "SERVING");
}

// Without --listen, moed binds loopback only (/proc/net/tcp: local address 0100007F).
TEST(SecurityDefaultsTest, MoedListensOnLoopbackByDefault) {
  const std::string dir = ::testing::TempDir();
  const std::string port_file = dir + "/default_listen.port";
  std::remove(port_file.c_str());
  const std::string secret_flag = "--cluster_secret_file=" + TestClusterSecretFile();
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string moed = RunfilePath("server/moed");
    const std::string port_flag = "--port_file=" + port_file;
    const std::string root_flag = "--checkpoint_root=" + dir + "/default_listen_root";
    execl(moed.c_str(), moed.c_str(), "--port=0", port_flag.c_str(), root_flag.c_str(),
          "--expect_workers=1", secret_flag.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int port = 0;
  for (int i = 0; i < 500 && port == 0; ++i) {
    std::ifstream in(port_file);
    if (!(in >> port)) port = 0;
    if (port == 0) usleep(20000);
  }
  ASSERT_GT(port, 0);
  // gRPC binds an IPv4 address as an IPv4-mapped IPv6 socket where it can (/proc/net/tcp6).
  char hex_port[8];
  std::snprintf(hex_port, sizeof(hex_port), "%04X", port);
  std::vector<std::string> bound;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream tcp(table);
    std::string line;
    while (std::getline(tcp, line)) {
      std::istringstream fields(line);
      std::string slot, address;
      fields >> slot >> address;
      if (address.size() > 5 && address.substr(address.size() - 4) == hex_port) {
        bound.push_back(address.substr(0, address.size() - 5));
      }
    }
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ASSERT_FALSE(bound.empty());
  for (const std::string& address : bound) {
    EXPECT_TRUE(address == "0100007F" || address == "0000000000000000FFFF00000100007F")
        << "bound to " << address << ", not 127.0.0.1";
  }
}

}  // namespace
}  // namespace moe
