// ring_echo_server: a RingChannel server for tests of other callers (the Python twin,
// tests/transport/ring_python_test.py). Creates an anonymous region (nothing can stay in
// /dev/shm, even if killed), prints the path a caller opens ("/proc/PID/fd/N") on stdout,
// and answers until the caller closes (exit 0) or dies (exit 1):
//   "error:<text>"  -> INVALID_ARGUMENT "<text>"
//   "die"           -> the server kills itself (SIGKILL) without answering
//   "sleep:<ms>"    -> answers "slept" after <ms> milliseconds
//   anything else   -> echoed
//
//   ring_echo_server --ring_bytes=4096
#include <signal.h>
#include <unistd.h>

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/ring_channel.h"
#include "transport/shm_object.h"

ABSL_FLAG(uint64_t, ring_bytes, 1 << 20, "data bytes of each ring (a power of two)");

namespace {

absl::StatusOr<std::string> Answer(absl::string_view request) {
  if (absl::StartsWith(request, "error:")) return absl::InvalidArgumentError(request.substr(6));
  if (request == "die") raise(SIGKILL);
  int ms = 0;
  if (absl::StartsWith(request, "sleep:") && absl::SimpleAtoi(request.substr(6), &ms)) {
    absl::SleepFor(absl::Milliseconds(ms));
    return std::string("slept");
  }
  return std::string(request);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  moe::RingChannelOptions options;
  options.ring_bytes = absl::GetFlag(FLAGS_ring_bytes);
  absl::StatusOr<moe::ShmObject> object = moe::ShmObject::CreateAnonymous(
      "ring-echo", moe::RingChannel::RegionBytes(options.ring_bytes));
  if (!object.ok()) {
    std::fprintf(stderr, "%s\n", object.status().ToString().c_str());
    return 2;
  }
  const int fd = object->fd();
  absl::StatusOr<std::unique_ptr<moe::RingChannel>> channel =
      moe::RingChannel::Create(*std::move(object), moe::RingChannel::Role::kServer, options);
  if (!channel.ok()) {
    std::fprintf(stderr, "%s\n", channel.status().ToString().c_str());
    return 2;
  }
  std::printf("/proc/%d/fd/%d\n", static_cast<int>(getpid()), fd);
  std::fflush(stdout);
  const absl::Status served = (*channel)->Serve(Answer);
  if (!served.ok()) {
    std::fprintf(stderr, "ring_echo_server: %s\n", served.ToString().c_str());
    return 1;
  }
  return 0;
}
