// Helpers of the RingChannel tests: unique region names, forked peers, exit codes.
#ifndef MOED_TESTS_TRANSPORT_RING_TEST_UTIL_H_
#define MOED_TESTS_TRANSPORT_RING_TEST_UTIL_H_

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "transport/ring_channel.h"
#include "transport/shm_object.h"

namespace moe {
namespace testing_ring {

inline std::string UniqueName(const char* tag) {
  static int counter = 0;
  return absl::StrCat("/moed-ring-test-", tag, "-", getpid(), "-", counter++);
}

// Runs `body` in a child process, which exits with its return value (never returns there).
inline pid_t Fork(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  return pid;
}

// The child's exit code, or 100 + the signal that ended it.
inline int Reap(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

// A child that attaches to `name` as the server and serves `handler`: exit 0 when Serve
// returned OK, 1 when it failed, 2 when it could not attach.
inline pid_t ForkServer(const std::string& name, RingChannel::Handler handler,
                        RingChannelOptions options = {}) {
  return Fork([name, handler, options]() {
    absl::StatusOr<ShmObject> object = ShmObject::OpenNamed(name);
    if (!object.ok()) return 2;
    absl::StatusOr<std::unique_ptr<RingChannel>> channel =
        RingChannel::Attach(*std::move(object), RingChannel::Role::kServer, options);
    if (!channel.ok()) return 2;
    return (*channel)->Serve(handler).ok() ? 0 : 1;
  });
}

}  // namespace testing_ring
}  // namespace moe

#endif  // MOED_TESTS_TRANSPORT_RING_TEST_UTIL_H_
