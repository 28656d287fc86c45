// Small helpers of moed's main (server/moed_main.cc).
#ifndef MOED_SERVER_MOED_UTIL_H_
#define MOED_SERVER_MOED_UTIL_H_

#include <string>

#include "absl/status/statusor.h"

namespace moe {

// `checkpoint_root` when set, else STATE_DIR/checkpoints, STATE_DIR being `state_dir` or its
// default ($XDG_STATE_HOME/moed, else $HOME/.local/state/moed); INVALID_ARGUMENT without
// a home folder.
absl::StatusOr<std::string> CheckpointRootPath(const std::string& checkpoint_root,
                                               const std::string& state_dir);

// `path` made absolute against the working directory (unchanged when it already is).
std::string AbsolutePath(const std::string& path);

// Writes `port` to `path` (atomically, through a rename); nothing when `path` is empty.
void WritePortFile(const std::string& path, int port);

// Whether `host` names the loopback interface.
bool IsLoopback(const std::string& host);

}  // namespace moe

#endif  // MOED_SERVER_MOED_UTIL_H_
