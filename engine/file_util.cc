#include "engine/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("write ", path));
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

std::string DirName(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::Status ErrnoStatus(int err, absl::string_view what) {
  std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status MakeDirectories(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("MakeDirectories: empty path");
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, absl::StrCat("mkdir ", prefix));
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", dir));
  if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(dir + " is not a directory");
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::vector<absl::string_view>& pieces) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("create ", tmp));
  absl::Status status;
  for (absl::string_view piece : pieces) {
    status = WriteAll(fd, piece, tmp);
    if (!status.ok()) break;
  }
  if (status.ok() && ::fsync(fd) != 0) status = ErrnoStatus(errno, absl::StrCat("fsync ", tmp));
  if (::close(fd) != 0 && status.ok()) status = ErrnoStatus(errno, absl::StrCat("close ", tmp));
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = ErrnoStatus(errno, absl::StrCat("rename ", tmp, " to ", path));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  // Make the rename itself durable.
  const std::string dir = DirName(path);
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return ErrnoStatus(errno, absl::StrCat("open directory ", dir));
  if (::fsync(dir_fd) != 0) status = ErrnoStatus(errno, absl::StrCat("fsync directory ", dir));
  ::close(dir_fd);
  return status;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("open ", path));
  std::string data;
  char buffer[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return ErrnoStatus(err, absl::StrCat("read ", path));
    }
    if (n == 0) break;
    data.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return data;
}

}  // namespace moe
