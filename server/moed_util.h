// Small helpers of moed's main (server/moed_main.cc).
#ifndef MOED_SERVER_MOED_UTIL_H_
#define MOED_SERVER_MOED_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
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

// --unix_socket's path, made ready for gRPC to bind: nothing there, or a stale socket (one
// nobody accepts on: a moed that was killed) is removed. FAILED_PRECONDITION, touching
// nothing, when the path holds anything else (a file, a folder, a link: moed removes no other
// kind of file) or a socket another process listens on.
absl::Status PrepareUnixSocketPath(const std::string& path);

// The socket moed bound at `path`: owner and group may connect (0660), and UnixSocket's
// destructor removes it, unless something else has replaced it since (another inode).
class UnixSocket {
 public:
  // FAILED_PRECONDITION when `path` is not a socket (the bind did not happen).
  static absl::StatusOr<std::unique_ptr<UnixSocket>> Adopt(const std::string& path);
  ~UnixSocket();
  UnixSocket(const UnixSocket&) = delete;
  UnixSocket& operator=(const UnixSocket&) = delete;

 private:
  UnixSocket(std::string path, uint64_t device, uint64_t inode)
      : path_(std::move(path)), device_(device), inode_(inode) {}
  const std::string path_;
  const uint64_t device_, inode_;
};

}  // namespace moe

#endif  // MOED_SERVER_MOED_UTIL_H_
