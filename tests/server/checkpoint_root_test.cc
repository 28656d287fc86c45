// CheckpointRoot: names are confined to the root, links are never followed, only moed's own
// checkpoints are replaced, staging of a dead moed is removed. Every refusal checks that the
// filesystem outside (and the refused target) is untouched.
#include "server/checkpoint_root.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/server/fs_snapshot.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// Every file under `dir` with its contents (directories as "<dir>"; links as "-> target").

void WriteFile(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

class CheckpointRootTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ =
        fs::path(::testing::TempDir()) /
        absl::StrCat("ckroot_", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    outside_ = base_ / "outside";
    WriteFile(outside_ / "passwd", "root:x:0:0\n");
    WriteFile(outside_ / "keep" / "data.bin", "precious");
    auto opened = CheckpointRoot::Open((base_ / "root").string());
    ASSERT_TRUE(opened.ok()) << opened.status();
    root_ = std::move(*opened);
    outside_before_ = SnapshotTree(outside_);
  }
  void TearDown() override {
    EXPECT_EQ(SnapshotTree(outside_), outside_before_) << "outside changed";
  }

  // A save with a fake worker: one file in the staging directory.
  absl::Status Save(const std::string& name, const std::string& contents) {
    auto staging = root_->BeginSave(name);
    if (!staging.ok()) return staging.status();
    WriteFile(fs::path(staging->path) / "weights.bin", contents);
    return root_->CommitSave(*staging);
  }

  fs::path base_, outside_;
  std::unique_ptr<CheckpointRoot> root_;
  std::map<std::string, std::string> outside_before_;
};

TEST_F(CheckpointRootTest, RootIsPrivate) {
  struct stat st;
  ASSERT_EQ(::stat(root_->path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

TEST_F(CheckpointRootTest, NamesOutsideTheRootAreRefused) {
  for (const char* name :
       {"", "/", "/etc", "/dev/null", "../outside", "a/../../outside", "./a", "a/./b", "a//b",
        ".staging/x", ".hidden", "a/..", "it's", "a b", "a\\b", "x\n", "a/", "run/layer0//"}) {
    auto staging = root_->BeginSave(name);
    EXPECT_EQ(staging.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(root_->ResolveForLoad(name).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
  EXPECT_EQ(root_->BeginSave(std::string(2000, 'a')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(root_->BeginSave(std::string(300, 'a')).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::string deep = "a";
  for (int i = 0; i < 20; ++i) deep += "/a";
  EXPECT_EQ(root_->BeginSave(deep).status().code(), absl::StatusCode::kInvalidArgument);
  // Only the root and its staging exist: nothing was created for a refused name.
  EXPECT_EQ(fs::path(root_->path()), fs::canonical(base_ / "root"));
  for (const auto& entry : fs::directory_iterator(root_->path())) {
    EXPECT_EQ(entry.path().filename(), ".staging");
  }
}

TEST_F(CheckpointRootTest, SavesReplacesAndLoads) {
  ASSERT_TRUE(Save("run/layer0", "v1").ok());
  ASSERT_TRUE(Save("run/layer0", "v2").ok());
  auto dir = root_->ResolveForLoad("run/layer0");
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(*dir, root_->path() + "/run/layer0");
  std::ifstream in(*dir + "/weights.bin");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "v2");
  EXPECT_TRUE(fs::is_regular_file(*dir + "/" + kCheckpointMarker));
  // Neither the replaced checkpoint nor a staging directory is left.
  for (const auto& entry : fs::recursive_directory_iterator(root_->path() + "/.staging")) {
    EXPECT_FALSE(entry.is_directory() && entry.path().parent_path().filename() != ".staging")
        << entry.path();
  }
  EXPECT_EQ(root_->ResolveForLoad("run/missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(root_->ResolveForLoad("nothere/x").status().code(), absl::StatusCode::kNotFound);
  // Checkpoints do not nest: a save inside one would be deleted with it.
  EXPECT_EQ(Save("run/layer0/inner", "x").code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CheckpointRootTest, NeverReplacesWhatMoedDidNotWrite) {
  const fs::path root = root_->path();
  WriteFile(root / "plain" / "notes.txt", "mine");
  WriteFile(root / "file", "a file");
  const auto before = SnapshotTree(root / "plain");
  for (const char* name : {"plain", "file"}) {
    EXPECT_EQ(Save(name, "x").code(), absl::StatusCode::kFailedPrecondition) << name;
    EXPECT_EQ(root_->ResolveForLoad(name).status().code(), absl::StatusCode::kFailedPrecondition)
        << name;
  }
  EXPECT_EQ(SnapshotTree(root / "plain"), before);
  std::ifstream in(root / "file");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "a file");
}

TEST_F(CheckpointRootTest, SymbolicLinksAreNeverFollowed) {
  const fs::path root = root_->path();
  fs::create_directory_symlink(outside_, root / "escape");
  fs::create_symlink(outside_ / "passwd", root / "pw");
  fs::create_directory_symlink(outside_ / "keep", root / "final");
  for (const char* name : {"escape/ckpt", "escape/keep", "pw", "final", "escape/new/deep"}) {
    const absl::Status saved = Save(name, "x");
    EXPECT_EQ(saved.code(), absl::StatusCode::kInvalidArgument) << name << ": " << saved;
    EXPECT_THAT(saved.message(), HasSubstr("symbolic link")) << name;
    EXPECT_EQ(root_->ResolveForLoad(name).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
  // The links themselves are still there, unchanged.
  EXPECT_EQ(fs::read_symlink(root / "escape"), outside_);
  EXPECT_EQ(fs::read_symlink(root / "final"), outside_ / "keep");
  // TearDown checks that nothing outside changed.
}

TEST_F(CheckpointRootTest, AbortLeavesNothing) {
  auto staging = root_->BeginSave("aborted");
  ASSERT_TRUE(staging.ok());
  WriteFile(fs::path(staging->path) / "partial", "half");
  root_->AbortSave(*staging);
  EXPECT_FALSE(fs::exists(staging->path));
  EXPECT_FALSE(fs::exists(fs::path(root_->path()) / "aborted"));
}

TEST_F(CheckpointRootTest, StagingOfADeadMoedIsRemovedAtStart) {
  const fs::path staging = fs::path(root_->path()) / ".staging";
  // A save interrupted by a kill: a staging folder whose lock nobody holds.
  WriteFile(staging / "999-dead" / "7" / "weights.bin", "partial");
  WriteFile(staging / "999-dead.lock", "");
  // Another live instance (lock held) keeps its staging.
  WriteFile(staging / "live" / "3" / "w", "in progress");
  const int lock = ::open((staging / "live.lock").c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(lock, 0);
  ASSERT_EQ(::flock(lock, LOCK_EX), 0);
  // flock locks belong to the open file description: a second Open in this process sees the
  // held lock of `live` as another instance's.
  auto second = CheckpointRoot::Open((base_ / "root").string());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(fs::exists(staging / "999-dead"));
  EXPECT_FALSE(fs::exists(staging / "999-dead.lock"));
  EXPECT_TRUE(fs::exists(staging / "live" / "3" / "w"));
  // The first instance is alive too: its staging folder survived the second's start.
  auto in_progress = root_->BeginSave("still-works");
  ASSERT_TRUE(in_progress.ok()) << in_progress.status();
  root_->AbortSave(*in_progress);
  ::close(lock);
}

TEST_F(CheckpointRootTest, RefusesARootOfAnotherUserOrAFile) {
  WriteFile(base_ / "a-file", "x");
  EXPECT_FALSE(CheckpointRoot::Open((base_ / "a-file").string()).ok());
  EXPECT_EQ(CheckpointRoot::Open("relative/root").status().code(),
            absl::StatusCode::kInvalidArgument);
  if (::geteuid() == 0) {
    const fs::path other = base_ / "other-user";
    fs::create_directories(other);
    ASSERT_EQ(::chown(other.c_str(), 12345, 12345), 0);
    EXPECT_EQ(CheckpointRoot::Open(other.string()).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace moe
