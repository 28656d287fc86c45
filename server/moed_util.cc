#include "server/moed_util.h"

#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace moe {

std::string AbsolutePath(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  char cwd[4096];
  if (::getcwd(cwd, sizeof(cwd)) == nullptr) return path;
  return absl::StrCat(cwd, "/", path);
}

absl::StatusOr<std::string> CheckpointRootPath(const std::string& checkpoint_root,
                                               const std::string& state_dir) {
  if (!checkpoint_root.empty()) return checkpoint_root;
  std::string state = state_dir;
  if (state.empty()) {
    const char* xdg = std::getenv("XDG_STATE_HOME");
    const char* home = std::getenv("HOME");
    if (home == nullptr || home[0] != '/') {
      const struct passwd* user = getpwuid(geteuid());
      home = user != nullptr ? user->pw_dir : nullptr;
    }
    if (xdg != nullptr && xdg[0] == '/') {
      state = absl::StrCat(xdg, "/moed");
    } else if (home != nullptr && home[0] == '/') {
      state = absl::StrCat(home, "/.local/state/moed");
    } else {
      return absl::InvalidArgumentError("no home folder: give --state_dir or --checkpoint_root");
    }
  }
  return absl::StrCat(state, "/checkpoints");
}

void WritePortFile(const std::string& path, int port) {
  if (path.empty()) return;
  std::ofstream(path + ".tmp") << port << "\n";
  std::rename((path + ".tmp").c_str(), path.c_str());
}

bool IsLoopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host == "[::1]" ||
         host.rfind("127.", 0) == 0;
}

namespace {

// Whether a process accepts connections on the Unix-domain socket at `path`.
bool SomeoneListens(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return connected;
}

}  // namespace

absl::Status PrepareUnixSocketPath(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("--unix_socket=", path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--unix_socket=", path, " exists and is not a socket; moed removes nothing else"));
  }
  if (SomeoneListens(path)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--unix_socket=", path, " is in use by another process"));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--unix_socket=", path, ": cannot remove the stale socket: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<UnixSocket>> UnixSocket::Adopt(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("--unix_socket=", path, ": not bound"));
  }
  if (::chmod(path.c_str(), 0660) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--unix_socket=", path, ": chmod: ", std::strerror(errno)));
  }
  return std::unique_ptr<UnixSocket>(new UnixSocket(path, st.st_dev, st.st_ino));
}

UnixSocket::~UnixSocket() {
  struct stat st;
  if (::lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) &&
      static_cast<uint64_t>(st.st_dev) == device_ && static_cast<uint64_t>(st.st_ino) == inode_) {
    ::unlink(path_.c_str());
  }
}

}  // namespace moe
