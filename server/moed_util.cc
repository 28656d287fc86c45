#include "server/moed_util.h"

#include <pwd.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
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

}  // namespace moe
