// RingChannel (transport/ring_channel.h) between real processes: round trips (wrapping
// records, the largest record, handler errors), a server killed mid-call, a slow server and
// the late answer, a caller killed mid-record, a full ring, and the setup errors.
#include "transport/ring_channel.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/transport/ring_test_util.h"

namespace moe {
namespace {

using testing_ring::Fork;
using testing_ring::ForkServer;
using testing_ring::Reap;
using testing_ring::UniqueName;

constexpr uint64_t kSmallRing = 4096;

// A caller-created channel named `name`, the name unlinked once `server` attached.
std::unique_ptr<RingChannel> MakeCaller(const std::string& name, uint64_t ring_bytes) {
  RingChannelOptions options;
  options.ring_bytes = ring_bytes;
  absl::StatusOr<ShmObject> object =
      ShmObject::CreateNamed(name, RingChannel::RegionBytes(ring_bytes));
  EXPECT_TRUE(object.ok()) << object.status();
  absl::StatusOr<std::unique_ptr<RingChannel>> channel =
      RingChannel::Create(*std::move(object), RingChannel::Role::kCaller, options);
  EXPECT_TRUE(channel.ok()) << channel.status();
  return channel.ok() ? *std::move(channel) : nullptr;
}

void AttachedThenUnlink(RingChannel& channel) {
  ASSERT_TRUE(channel.WaitForPeer(absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE(channel.object().Unlink().ok());
  struct stat st;
  EXPECT_NE(stat(absl::StrCat("/dev/shm", channel.name()).c_str(), &st), 0);
}

absl::StatusOr<std::string> Echo(absl::string_view request) {
  if (absl::StartsWith(request, "error:")) {
    return absl::InvalidArgumentError(request.substr(6));
  }
  return std::string(request);
}

TEST(RingChannelTest, RoundTripsWrapAndCarryErrors) {
  const std::string name = UniqueName("echo");
  std::unique_ptr<RingChannel> caller = MakeCaller(name, kSmallRing);
  ASSERT_NE(caller, nullptr);
  const pid_t server = ForkServer(name, Echo);
  AttachedThenUnlink(*caller);

  std::mt19937 random(7);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  // Sizes that put record boundaries and the wrap everywhere, up to the largest record.
  for (int round = 0; round < 40; ++round) {
    for (size_t size : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{256},
                        size_t{1000}, size_t{kSmallRing - 16}}) {
      std::string request(size, '\0');
      for (char& c : request) c = static_cast<char>(random());
      if (size >= 6) request[0] = 'x';  // never "error:"
      absl::StatusOr<std::string> response = caller->Call(request, deadline);
      ASSERT_TRUE(response.ok()) << response.status() << " size " << size;
      ASSERT_EQ(*response, request) << "size " << size;
    }
  }
  absl::StatusOr<std::string> error = caller->Call("error:bad shape", deadline);
  EXPECT_EQ(error.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(error.status().message(), "bad shape");
  EXPECT_EQ(caller->Call(std::string(kSmallRing - 15, 'x'), deadline).status().code(),
            absl::StatusCode::kInvalidArgument);  // never fits
  EXPECT_TRUE(caller->Call("still fine", deadline).ok());

  caller.reset();  // closes: the server's Serve returns OK
  EXPECT_EQ(Reap(server), 0);
}

TEST(RingChannelTest, ServerKilledMidCallIsUnavailableWithinTheDeadline) {
  const std::string name = UniqueName("killed-server");
  std::unique_ptr<RingChannel> caller = MakeCaller(name, kSmallRing);
  ASSERT_NE(caller, nullptr);
  const pid_t server =
      ForkServer(name, [](absl::string_view request) -> absl::StatusOr<std::string> {
        if (request == "die") raise(SIGKILL);  // mid-call: the request read, no answer
        return std::string(request);
      });
  AttachedThenUnlink(*caller);
  ASSERT_TRUE(caller->Call("ping", absl::Now() + absl::Seconds(10)).ok());

  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> response = caller->Call("die", start + absl::Seconds(10));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable) << response.status();
  EXPECT_TRUE(absl::StrContains(response.status().message(), "exited")) << response.status();
  EXPECT_LT(took, absl::Seconds(2));  // one peer check (20 ms) after the death, not 10 s
  // Not reaped yet (a zombie) and reaped: both dead.
  EXPECT_EQ(caller->Call("again", absl::Now() + absl::Seconds(5)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(Reap(server), 100 + SIGKILL);
  EXPECT_EQ(caller->Call("again", absl::Now() + absl::Seconds(5)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(RingChannelTest, LateAnswerOfATimedOutCallIsSkipped) {
  const std::string name = UniqueName("slow");
  std::unique_ptr<RingChannel> caller = MakeCaller(name, kSmallRing);
  ASSERT_NE(caller, nullptr);
  const pid_t server =
      ForkServer(name, [](absl::string_view request) -> absl::StatusOr<std::string> {
        if (request == "slow") absl::SleepFor(absl::Milliseconds(300));
        return absl::StrCat("re:", request);
      });
  AttachedThenUnlink(*caller);
  const absl::Time start = absl::Now();
  EXPECT_EQ(caller->Call("slow", start + absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(250));
  absl::StatusOr<std::string> next = caller->Call("fast", absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(*next, "re:fast");  // not "re:slow"
  caller.reset();
  EXPECT_EQ(Reap(server), 0);
}

TEST(RingChannelTest, CallerKilledMidRecordIsNeverDeliveredAndFreesTheServer) {
  const std::string name = UniqueName("killed-caller");
  RingChannelOptions options;
  options.ring_bytes = kSmallRing;
  absl::StatusOr<ShmObject> object =
      ShmObject::CreateNamed(name, RingChannel::RegionBytes(kSmallRing));
  ASSERT_TRUE(object.ok());
  absl::StatusOr<std::unique_ptr<RingChannel>> server =
      RingChannel::Create(*std::move(object), RingChannel::Role::kServer, options);
  ASSERT_TRUE(server.ok()) << server.status();

  const pid_t caller = Fork([name]() {
    absl::StatusOr<ShmObject> object = ShmObject::OpenNamed(name);
    if (!object.ok()) return 2;
    absl::StatusOr<ShmMapping> raw = object->Map();  // to write half a record by hand
    absl::StatusOr<std::unique_ptr<RingChannel>> channel =
        RingChannel::Attach(*std::move(object), RingChannel::Role::kCaller);
    if (!channel.ok() || !raw.ok()) return 2;
    for (int i = 0; i < 3; ++i) {
      if (!(*channel)->Call(absl::StrCat("call ", i), absl::Now() + absl::Seconds(10)).ok()) {
        return 3;
      }
    }
    // A fourth record, its header and half its payload written, head not yet published.
    auto* control = reinterpret_cast<ring_layout::RingControl*>(raw->data() +
                                                                ring_layout::kRequestControlOffset);
    const uint64_t head = control->head.load();
    char* at = raw->data() + ring_layout::kDataOffset + head % kSmallRing;
    const ring_layout::RecordHeader header{100, 0, 4};
    std::memcpy(at, &header, sizeof(header));
    std::memset(at + sizeof(header), 'h', 50);
    raise(SIGKILL);
    return 4;
  });

  int handled = 0;
  const absl::Time start = absl::Now();
  const absl::Status served = (*server)->Serve([&](absl::string_view request) {
    ++handled;
    return std::string(request);
  });
  EXPECT_EQ(served.code(), absl::StatusCode::kUnavailable) << served;
  EXPECT_TRUE(absl::StrContains(served.message(), "caller process")) << served;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(handled, 3);  // the half record never reached the handler
  EXPECT_EQ(Reap(caller), 100 + SIGKILL);
  server->reset();  // the channel is freed: nothing left in /dev/shm
  struct stat st;
  EXPECT_NE(stat(absl::StrCat("/dev/shm", name).c_str(), &st), 0);
}

TEST(RingChannelTest, FullRingWaitsUntilTheDeadlineThenResourceExhausted) {
  const std::string name = UniqueName("full");
  std::unique_ptr<RingChannel> caller = MakeCaller(name, kSmallRing);
  ASSERT_NE(caller, nullptr);
  int go[2];
  ASSERT_EQ(pipe(go), 0);
  const pid_t server = Fork([name, go]() {
    absl::StatusOr<ShmObject> object = ShmObject::OpenNamed(name);
    if (!object.ok()) return 2;
    absl::StatusOr<std::unique_ptr<RingChannel>> channel =
        RingChannel::Attach(*std::move(object), RingChannel::Role::kServer);
    if (!channel.ok()) return 2;
    char byte;
    if (read(go[0], &byte, 1) != 1) return 3;  // attached, not serving yet
    return (*channel)->Serve(Echo).ok() ? 0 : 1;
  });
  AttachedThenUnlink(*caller);

  const std::string request(1100, 'r');  // 1120 bytes a record: three fit in 4096
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(caller->Call(request, absl::Now() + absl::Milliseconds(20)).status().code(),
              absl::StatusCode::kDeadlineExceeded);  // queued, unanswered
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> full = caller->Call(request, start + absl::Milliseconds(100));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_GE(waited, absl::Milliseconds(100));
  EXPECT_LT(waited, absl::Seconds(1));

  ASSERT_EQ(write(go[1], "g", 1), 1);  // the server drains the ring; calls work again
  absl::StatusOr<std::string> after = caller->Call("after", absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, "after");
  caller.reset();
  EXPECT_EQ(Reap(server), 0);
  close(go[0]);
  close(go[1]);
}

TEST(RingChannelTest, SetupErrors) {
  RingChannelOptions options;
  options.ring_bytes = kSmallRing;
  // Sizes: the object must be exactly the region; ring_bytes a power of two >= 4096.
  absl::StatusOr<ShmObject> small = ShmObject::CreateAnonymous("small", 8192);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(
      RingChannel::Create(*std::move(small), RingChannel::Role::kCaller, options).status().code(),
      absl::StatusCode::kInvalidArgument);
  options.ring_bytes = 5000;
  absl::StatusOr<ShmObject> odd = ShmObject::CreateAnonymous("odd", RingChannel::RegionBytes(5000));
  EXPECT_EQ(
      RingChannel::Create(*std::move(odd), RingChannel::Role::kCaller, options).status().code(),
      absl::StatusCode::kInvalidArgument);
  options.ring_bytes = kSmallRing;

  // A role is taken once; the other role on the wrong side is refused.
  absl::StatusOr<ShmObject> object =
      ShmObject::CreateAnonymous("roles", RingChannel::RegionBytes(kSmallRing));
  ASSERT_TRUE(object.ok());
  const std::string path = absl::StrCat("/proc/self/fd/", object->fd());
  absl::StatusOr<std::unique_ptr<RingChannel>> caller =
      RingChannel::Create(*std::move(object), RingChannel::Role::kCaller, options);
  ASSERT_TRUE(caller.ok()) << caller.status();
  absl::StatusOr<ShmObject> again = ShmObject::OpenPath(path);
  ASSERT_TRUE(again.ok()) << again.status();
  absl::StatusOr<std::unique_ptr<RingChannel>> second =
      RingChannel::Attach(*std::move(again), RingChannel::Role::kCaller);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_EQ((*caller)->Serve(Echo).code(), absl::StatusCode::kFailedPrecondition);

  // A server no caller attaches to gives up after attach_timeout.
  absl::StatusOr<ShmObject> lonely =
      ShmObject::CreateAnonymous("lonely", RingChannel::RegionBytes(kSmallRing));
  options.attach_timeout = absl::Milliseconds(100);
  absl::StatusOr<std::unique_ptr<RingChannel>> server =
      RingChannel::Create(*std::move(lonely), RingChannel::Role::kServer, options);
  ASSERT_TRUE(server.ok());
  EXPECT_EQ((*server)->Call("x", absl::Now()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const absl::Time start = absl::Now();
  EXPECT_EQ((*server)->Serve(Echo).code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(RingChannelTest, StopEndsServe) {
  absl::StatusOr<ShmObject> object =
      ShmObject::CreateAnonymous("stop", RingChannel::RegionBytes(kSmallRing));
  RingChannelOptions options;
  options.ring_bytes = kSmallRing;
  absl::StatusOr<std::unique_ptr<RingChannel>> server =
      RingChannel::Create(*std::move(object), RingChannel::Role::kServer, options);
  ASSERT_TRUE(server.ok());
  (*server)->Stop();
  EXPECT_TRUE((*server)->Serve(Echo).ok());
}

}  // namespace
}  // namespace moe
