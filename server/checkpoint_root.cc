#include "server/checkpoint_root.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "engine/file_util.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

constexpr char kStaging[] = ".staging";
constexpr size_t kMaxNameBytes = 1024;
constexpr size_t kMaxComponentBytes = 255;
constexpr size_t kMaxDepth = 16;
// The marker's line with the saved layer's optimizer_step.
constexpr char kOptimizerStepKey[] = "optimizer_step: ";
constexpr int kDirFlags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;

// Closes a descriptor on every way out of a scope.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

bool ValidChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-' || c == '.';
}

// Removes `name` inside `parent_fd`: a directory with everything in it (symbolic links are
// unlinked, never followed), or a single file. Best effort: errors are ignored.
void RemoveTreeAt(int parent_fd, const std::string& name) {
  int fd = ::openat(parent_fd, name.c_str(), kDirFlags);
  if (fd < 0) {
    ::unlinkat(parent_fd, name.c_str(), 0);
    return;
  }
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    ::close(fd);
    return;
  }
  std::vector<std::string> entries;
  while (struct dirent* entry = ::readdir(dir)) {
    const std::string child = entry->d_name;
    if (child != "." && child != "..") entries.push_back(child);
  }
  for (const std::string& child : entries) {
    struct stat st;
    if (::fstatat(fd, child.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
      RemoveTreeAt(fd, child);
    } else {
      ::unlinkat(fd, child.c_str(), 0);
    }
  }
  ::closedir(dir);  // closes fd
  ::unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR);
}

// True when `fd` (a directory) holds the checkpoint marker as a regular file.
bool HasMarker(int fd) {
  struct stat st;
  return ::fstatat(fd, kCheckpointMarker, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
}

// What is at `last` inside `parent_fd`.
enum class Target { kAbsent, kCheckpoint };

absl::StatusOr<Target> InspectTarget(int parent_fd, const std::string& last,
                                     const std::string& name) {
  struct stat st;
  if (::fstatat(parent_fd, last.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return Target::kAbsent;
    return ErrnoStatus(errno, absl::StrCat("directory: \"", name, "\""));
  }
  if (S_ISLNK(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "directory: \"", name, "\" is a symbolic link; checkpoint paths never follow links"));
  }
  if (S_ISDIR(st.st_mode)) {
    Fd fd(::openat(parent_fd, last.c_str(), kDirFlags));
    if (fd.get() >= 0 && HasMarker(fd.get())) return Target::kCheckpoint;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("directory: \"", name,
                   "\" exists and is not a checkpoint written by moed; it is never replaced"));
}

absl::Status MakeDirectoriesPrivate(const std::string& path) {
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string prefix = path.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, absl::StrCat("checkpoint root: mkdir ", prefix));
    }
  }
  return absl::OkStatus();
}

std::string RandomHex() {
  std::random_device device;
  return absl::StrCat(absl::Hex(device(), absl::kZeroPad8), absl::Hex(device(), absl::kZeroPad8));
}

// Removes staging folders under `staging_fd` whose owner (the moed holding "<name>.lock")
// is gone. A lock is taken before its folder is made and dropped after it is removed.
void RemoveOrphanedStaging(int staging_fd) {
  Fd listing(::openat(staging_fd, ".", kDirFlags));
  DIR* dir = listing.get() >= 0 ? ::fdopendir(listing.release()) : nullptr;
  if (dir == nullptr) return;
  std::vector<std::string> names;
  while (struct dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  for (const std::string& name : names) {
    const bool is_lock = name.size() > 5 && name.compare(name.size() - 5, 5, ".lock") == 0;
    const std::string base = is_lock ? name.substr(0, name.size() - 5) : name;
    Fd lock(::openat(staging_fd, (base + ".lock").c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
    if (lock.get() >= 0 && ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) continue;  // alive
    RemoveTreeAt(staging_fd, base);
    if (lock.get() >= 0) ::unlinkat(staging_fd, (base + ".lock").c_str(), 0);
  }
}

}  // namespace

CheckpointRoot::CheckpointRoot(std::string path, int root_fd, int staging_fd, std::string instance)
    : path_(std::move(path)),
      root_fd_(root_fd),
      staging_fd_(staging_fd),
      instance_(std::move(instance)) {}

CheckpointRoot::~CheckpointRoot() {
  ::close(staging_fd_);
  Fd staging(::openat(root_fd_, kStaging, kDirFlags));
  if (staging.get() >= 0) {
    RemoveTreeAt(staging.get(), instance_);
    ::unlinkat(staging.get(), (instance_ + ".lock").c_str(), 0);  // closing it drops the flock
  }
  ::close(root_fd_);
}

absl::StatusOr<std::unique_ptr<CheckpointRoot>> CheckpointRoot::Open(const std::string& path) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint root: \"", path, "\" is not an absolute path"));
  }
  RETURN_IF_ERROR(MakeDirectoriesPrivate(path));
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) == nullptr) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint root: ", path));
  }
  Fd root(::open(resolved, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (root.get() < 0) return ErrnoStatus(errno, absl::StrCat("checkpoint root: open ", resolved));
  struct stat st;
  if (::fstat(root.get(), &st) != 0) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint root: stat ", resolved));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint root: ", resolved, " belongs to uid ", st.st_uid, ", not to moed's uid ",
        ::geteuid(), "; give moed a folder of its own (--checkpoint_root)"));
  }
  if ((st.st_mode & 077) != 0 && ::fchmod(root.get(), 0700) != 0) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint root: chmod 0700 ", resolved));
  }
  if (::mkdirat(root.get(), kStaging, 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint root: mkdir ", resolved, "/", kStaging));
  }
  Fd staging(::openat(root.get(), kStaging, kDirFlags));
  if (staging.get() < 0) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint root: open ", resolved, "/", kStaging));
  }
  RemoveOrphanedStaging(staging.get());

  // This instance's folder: the lock first (held for the life of the process; the
  // descriptor is deliberately kept open and inherited by no child), then the folder.
  const std::string instance = absl::StrCat(::getpid(), "-", RandomHex());
  const int lock = ::openat(staging.get(), (instance + ".lock").c_str(),
                            O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock < 0 || ::flock(lock, LOCK_EX | LOCK_NB) != 0) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint root: lock in ", resolved, "/", kStaging));
  }
  if (::mkdirat(staging.get(), instance.c_str(), 0700) != 0) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint root: mkdir staging in ", resolved));
  }
  Fd own(::openat(staging.get(), instance.c_str(), kDirFlags));
  if (own.get() < 0) return ErrnoStatus(errno, "checkpoint root: open staging");
  return std::unique_ptr<CheckpointRoot>(
      new CheckpointRoot(resolved, root.release(), own.release(), instance));
}

absl::StatusOr<std::string> CheckpointRoot::CheckName(absl::string_view field,
                                                      absl::string_view name) {
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": \"", name.substr(0, 128), name.size() > 128 ? "..." : "", "\" ", why,
        " (a checkpoint is named by a relative path inside the server's --checkpoint_root: "
        "components of letters, digits, '_', '-' and '.', not starting with '.')"));
  };
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  if (name.size() > kMaxNameBytes) return refuse(absl::StrCat("is over ", kMaxNameBytes, " bytes"));
  if (name[0] == '/') return refuse("is an absolute path");
  const std::vector<absl::string_view> parts = absl::StrSplit(name, '/');
  if (parts.size() > kMaxDepth) return refuse(absl::StrCat("is deeper than ", kMaxDepth));
  for (absl::string_view part : parts) {
    if (part.empty()) return refuse("has an empty component");
    if (part == "." || part == "..") return refuse("has a \".\" or \"..\" component");
    if (part[0] == '.') return refuse("has a component starting with '.'");
    if (part.size() > kMaxComponentBytes) return refuse("has a component over 255 bytes");
    for (char c : part) {
      if (!ValidChar(c)) return refuse("has a character outside [A-Za-z0-9_.-]");
    }
  }
  return std::string(name);
}

absl::StatusOr<int> CheckpointRoot::OpenParent(const std::string& name, bool create,
                                               std::string* last) const {
  const std::vector<std::string> parts = absl::StrSplit(name, '/');
  Fd dir(::openat(root_fd_, ".", kDirFlags));
  if (dir.get() < 0) return ErrnoStatus(errno, "checkpoint root");
  std::string walked;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    walked = walked.empty() ? parts[i] : absl::StrCat(walked, "/", parts[i]);
    int next = ::openat(dir.get(), parts[i].c_str(), kDirFlags);
    if (next < 0 && errno == ENOENT && create) {
      if (::mkdirat(dir.get(), parts[i].c_str(), 0700) != 0 && errno != EEXIST) {
        return ErrnoStatus(errno, absl::StrCat("directory: cannot create \"", walked, "\""));
      }
      next = ::openat(dir.get(), parts[i].c_str(), kDirFlags);
    }
    if (next < 0) {
      if (errno == ELOOP || errno == ENOTDIR) {
        return absl::InvalidArgumentError(
            absl::StrCat("directory: \"", walked,
                         "\" is a symbolic link or not a directory; checkpoint paths never "
                         "follow links"));
      }
      if (errno == ENOENT) {
        return absl::NotFoundError(
            absl::StrCat("directory: no checkpoint \"", name, "\" under the checkpoint root"));
      }
      return ErrnoStatus(errno, absl::StrCat("directory: \"", walked, "\""));
    }
    dir.reset(next);
    if (HasMarker(dir.get())) {
      return absl::FailedPreconditionError(
          absl::StrCat("directory: \"", walked, "\" is a checkpoint; checkpoints do not nest"));
    }
  }
  *last = parts.back();
  return dir.release();
}

absl::StatusOr<CheckpointRoot::Staging> CheckpointRoot::BeginSave(absl::string_view request_name) {
  ASSIGN_OR_RETURN(std::string name, CheckName("directory", request_name));
  std::string last;
  ASSIGN_OR_RETURN(int parent_fd, OpenParent(name, /*create=*/true, &last));
  Fd parent(parent_fd);
  RETURN_IF_ERROR(InspectTarget(parent.get(), last, name).status());
  Staging staging;
  staging.name = name;
  staging.id = absl::StrCat(next_id_++);
  if (::mkdirat(staging_fd_, staging.id.c_str(), 0700) != 0) {
    return ErrnoStatus(errno, "checkpoint root: cannot create a staging directory");
  }
  staging.path = absl::StrCat(path_, "/", kStaging, "/", instance_, "/", staging.id);
  return staging;
}

void CheckpointRoot::AbortSave(const Staging& staging) { RemoveTreeAt(staging_fd_, staging.id); }

absl::Status CheckpointRoot::CommitSave(const Staging& staging) {
  auto commit = [&]() -> absl::Status {
    {
      Fd dir(::openat(staging_fd_, staging.id.c_str(), kDirFlags));
      if (dir.get() < 0) return ErrnoStatus(errno, "checkpoint root: staging directory");
      Fd marker(::openat(dir.get(), kCheckpointMarker,
                         O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
      if (marker.get() < 0) return ErrnoStatus(errno, "checkpoint root: write marker");
      std::string text = absl::StrCat("moed checkpoint\nname: ", staging.name, "\n");
      if (staging.optimizer_step >= 0) {
        absl::StrAppend(&text, kOptimizerStepKey, staging.optimizer_step, "\n");
      }
      if (::write(marker.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()) ||
          ::fsync(marker.get()) != 0 || ::fsync(dir.get()) != 0) {
        return ErrnoStatus(errno, "checkpoint root: write marker");
      }
    }
    std::string last;
    ASSIGN_OR_RETURN(int parent_fd, OpenParent(staging.name, /*create=*/true, &last));
    Fd parent(parent_fd);
    ASSIGN_OR_RETURN(Target target, InspectTarget(parent.get(), last, staging.name));
    const char* from = staging.id.c_str();
    if (target == Target::kAbsent) {
      // NOREPLACE: a directory made in the meantime is never replaced by the rename.
      if (::renameat2(staging_fd_, from, parent.get(), last.c_str(), RENAME_NOREPLACE) != 0) {
        if (errno != EINVAL) return ErrnoStatus(errno, "directory: cannot move into place");
        if (::renameat(staging_fd_, from, parent.get(), last.c_str()) != 0) {
          return ErrnoStatus(errno, "directory: cannot move into place");
        }
      }
    } else if (::renameat2(staging_fd_, from, parent.get(), last.c_str(), RENAME_EXCHANGE) == 0) {
      RemoveTreeAt(staging_fd_, staging.id);  // the old checkpoint, swapped out
    } else {
      if (errno != EINVAL) return ErrnoStatus(errno, "directory: cannot replace the checkpoint");
      // No atomic exchange on this filesystem: move the old one aside first.
      const std::string old = staging.id + ".old";
      if (::renameat(parent.get(), last.c_str(), staging_fd_, old.c_str()) != 0) {
        return ErrnoStatus(errno, "directory: cannot move the old checkpoint aside");
      }
      if (::renameat(staging_fd_, from, parent.get(), last.c_str()) != 0) {
        const absl::Status failed = ErrnoStatus(errno, "directory: cannot move into place");
        ::renameat(staging_fd_, old.c_str(), parent.get(), last.c_str());
        return failed;
      }
      RemoveTreeAt(staging_fd_, old);
    }
    ::fsync(parent.get());
    return absl::OkStatus();
  };
  absl::Status status = commit();
  if (!status.ok()) AbortSave(staging);
  return status;
}

absl::StatusOr<std::string> CheckpointRoot::ResolveForLoad(absl::string_view request_name) const {
  ASSIGN_OR_RETURN(std::string name, CheckName("directory", request_name));
  std::string last;
  ASSIGN_OR_RETURN(int parent_fd, OpenParent(name, /*create=*/false, &last));
  Fd parent(parent_fd);
  ASSIGN_OR_RETURN(Target target, InspectTarget(parent.get(), last, name));
  if (target == Target::kAbsent) {
    return absl::NotFoundError(
        absl::StrCat("directory: no checkpoint \"", name, "\" under the checkpoint root"));
  }
  return absl::StrCat(path_, "/", name);
}

absl::StatusOr<int64_t> CheckpointRoot::SavedOptimizerStep(absl::string_view request_name) const {
  ASSIGN_OR_RETURN(std::string name, CheckName("directory", request_name));
  std::string last;
  ASSIGN_OR_RETURN(int parent_fd, OpenParent(name, /*create=*/false, &last));
  Fd parent(parent_fd);
  ASSIGN_OR_RETURN(Target target, InspectTarget(parent.get(), last, name));
  if (target == Target::kAbsent) {
    return absl::NotFoundError(
        absl::StrCat("directory: no checkpoint \"", name, "\" under the checkpoint root"));
  }
  Fd dir(::openat(parent.get(), last.c_str(), kDirFlags));
  if (dir.get() < 0) return ErrnoStatus(errno, absl::StrCat("directory: \"", name, "\""));
  Fd marker(::openat(dir.get(), kCheckpointMarker, O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (marker.get() < 0) return ErrnoStatus(errno, absl::StrCat("directory: \"", name, "\" marker"));
  char buffer[4096];
  const ssize_t n = ::read(marker.get(), buffer, sizeof(buffer));
  if (n < 0) return ErrnoStatus(errno, absl::StrCat("directory: \"", name, "\" marker"));
  for (absl::string_view line : absl::StrSplit(absl::string_view(buffer, n), '\n')) {
    int64_t step = 0;
    if (absl::ConsumePrefix(&line, kOptimizerStepKey) && absl::SimpleAtoi(line, &step) &&
        step >= 0) {
      return step;
    }
  }
  return -1;
}

}  // namespace moe