// A RingChannel whose peer writes bytes no honest peer writes (transport/ring_channel.h):
// random headers are refused at Attach, forged indices and lengths fail the channel with
// DATA_LOSS for good, and random bytes written while calls run end in a status, never a crash.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/transport/ring_test_util.h"
#include "transport/ring_channel.h"

namespace moe {
namespace {

using ring_layout::RingControl;
using testing_ring::Fork;
using testing_ring::Reap;

constexpr uint64_t kRing = 4096;

struct Region {
  ShmObject object;
  std::string path;  // /proc/self/fd/N: a second, independent open of the same object
};

Region MakeRegion() {
  Region region;
  region.object = *ShmObject::CreateAnonymous("corrupt", RingChannel::RegionBytes(kRing));
  region.path = absl::StrCat("/proc/", getpid(), "/fd/", region.object.fd());
  return region;
}

ShmObject Reopen(const Region& region) { return *ShmObject::OpenPath(region.path); }

TEST(RingCorruptionTest, RandomHeaderIsRefusedAtAttach) {
  std::mt19937_64 random(1);
  for (int trial = 0; trial < 300; ++trial) {
    Region region = MakeRegion();
    {
      ShmMapping view = *region.object.Map();
      for (size_t i = 0; i < ring_layout::kDataOffset; i += 8) {
        const uint64_t word = random();
        std::memcpy(view.data() + i, &word, 8);
      }
      if (trial % 3 == 1) {  // a right magic, the rest random
        const uint32_t magic = ring_layout::kMagic;
        std::memcpy(view.data(), &magic, 4);
      }
    }
    for (RingChannel::Role role : {RingChannel::Role::kCaller, RingChannel::Role::kServer}) {
      absl::StatusOr<std::unique_ptr<RingChannel>> channel =
          RingChannel::Attach(Reopen(region), role);
      EXPECT_EQ(channel.status().code(), absl::StatusCode::kInvalidArgument)
          << "trial " << trial << ": " << channel.status();
    }
  }
  // Too small to hold a header at all.
  EXPECT_EQ(RingChannel::Attach(*ShmObject::CreateAnonymous("tiny", 64), RingChannel::Role::kCaller)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RingCorruptionTest, ValidHeaderWithRandomIndicesIsDataLossOrWorks) {
  std::mt19937_64 random(2);
  for (int trial = 0; trial < 200; ++trial) {
    Region region = MakeRegion();
    RingChannelOptions options;
    options.ring_bytes = kRing;
    options.peer_check_interval = absl::Milliseconds(1);
    absl::StatusOr<std::unique_ptr<RingChannel>> server =
        RingChannel::Create(std::move(region.object), RingChannel::Role::kServer, options);
    ASSERT_TRUE(server.ok());
    {
      ShmMapping view = *Reopen(region).Map();  // the peer scribbles on both control blocks
      for (size_t i = ring_layout::kRequestControlOffset; i < 320; i += 8) {
        const uint64_t word = trial % 2 == 0 ? random() : random() % 8192;
        std::memcpy(view.data() + i, &word, 8);
      }
    }
    absl::StatusOr<std::unique_ptr<RingChannel>> caller =
        RingChannel::Attach(Reopen(region), RingChannel::Role::kCaller, options);
    if (!caller.ok()) {
      EXPECT_EQ(caller.status().code(), absl::StatusCode::kDataLoss) << caller.status();
      continue;
    }
    absl::StatusOr<std::string> response =
        (*caller)->Call("x", absl::Now() + absl::Milliseconds(5));
    EXPECT_FALSE(response.ok());  // nobody serves; whatever came back is refused or times out
  }
}

// The peer (a child process) forges one value, then the caller's next call must fail with
// DATA_LOSS, and every later call too.
class ForgedValueTest : public ::testing::TestWithParam<int> {};

TEST_P(ForgedValueTest, FailsTheChannelForGood) {
  Region region = MakeRegion();
  RingChannelOptions options;
  options.ring_bytes = kRing;
  absl::StatusOr<std::unique_ptr<RingChannel>> caller =
      RingChannel::Create(std::move(region.object), RingChannel::Role::kCaller, options);
  ASSERT_TRUE(caller.ok());
  const int forgery = GetParam();
  const pid_t peer = Fork([&region, forgery]() {
    absl::StatusOr<ShmObject> object = ShmObject::OpenPath(region.path);
    if (!object.ok()) return 2;
    absl::StatusOr<ShmMapping> view = object->Map();
    absl::StatusOr<std::unique_ptr<RingChannel>> server =
        RingChannel::Attach(*std::move(object), RingChannel::Role::kServer);
    if (!server.ok() || !view.ok()) return 2;
    char* base = view->data();
    auto* requests = reinterpret_cast<RingControl*>(base + ring_layout::kRequestControlOffset);
    auto* responses = reinterpret_cast<RingControl*>(base + ring_layout::kResponseControlOffset);
    char* response_data = base + ring_layout::kDataOffset + kRing;
    switch (forgery) {
      case 0:  // the consumer claims to have consumed what was never published
        requests->tail.store(4096);
        break;
      case 1:  // a published head a whole ring and more ahead
        responses->head.store(kRing + 16);
        break;
      case 2: {  // a record whose length exceeds what was published
        const ring_layout::RecordHeader header{1000, 0, 1};
        std::memcpy(response_data, &header, sizeof(header));
        responses->head.store(32);
        break;
      }
      case 3: {  // a length beyond the ring itself
        const ring_layout::RecordHeader header{0xFFFFFFF0u, 0, 1};
        std::memcpy(response_data, &header, sizeof(header));
        responses->head.store(kRing);
        break;
      }
      case 4: {  // an answer to a call never made
        const ring_layout::RecordHeader header{0, 0, 99};
        std::memcpy(response_data, &header, sizeof(header));
        responses->head.store(16);
        break;
      }
      case 5: {  // a status code that does not exist
        const ring_layout::RecordHeader header{0, 77, 1};
        std::memcpy(response_data, &header, sizeof(header));
        responses->head.store(16);
        break;
      }
    }
    pause();  // stays alive: the failure is the forgery's, not a dead peer's
    return 0;
  });
  ASSERT_TRUE((*caller)->WaitForPeer(absl::Now() + absl::Seconds(10)).ok());
  absl::SleepFor(absl::Milliseconds(50));  // the forgery is written
  absl::Status first = (*caller)->Call("x", absl::Now() + absl::Seconds(5)).status();
  EXPECT_EQ(first.code(), absl::StatusCode::kDataLoss) << first;
  EXPECT_TRUE(absl::StrContains(first.message(), "corrupt")) << first;
  if (forgery <= 3) {  // a broken ring stays broken
    EXPECT_EQ((*caller)->Call("y", absl::Now() + absl::Seconds(5)).status().code(),
              absl::StatusCode::kDataLoss);
  }
  kill(peer, SIGKILL);
  EXPECT_EQ(Reap(peer), 100 + SIGKILL);
}

INSTANTIATE_TEST_SUITE_P(Forgeries, ForgedValueTest, ::testing::Range(0, 6));

// Random bytes over the control blocks and data while a server thread serves and the caller
// calls: every call ends in some status by its deadline, Serve ends, nothing crashes.
TEST(RingCorruptionTest, ScribblingPeerNeverCrashesEitherSide) {
  Region region = MakeRegion();
  RingChannelOptions options;
  options.ring_bytes = kRing;
  options.peer_check_interval = absl::Milliseconds(2);
  absl::StatusOr<std::unique_ptr<RingChannel>> server =
      RingChannel::Create(std::move(region.object), RingChannel::Role::kServer, options);
  ASSERT_TRUE(server.ok());
  absl::StatusOr<std::unique_ptr<RingChannel>> caller =
      RingChannel::Attach(Reopen(region), RingChannel::Role::kCaller, options);
  ASSERT_TRUE(caller.ok());
  std::thread serving(
      [&] { (void)(*server)->Serve([](absl::string_view r) { return std::string(r); }); });
  std::atomic<bool> done{false};
  ShmMapping view = *Reopen(region).Map();
  std::thread scribbler([&] {
    std::mt19937_64 random(3);
    while (!done.load()) {
      // Half the time the control blocks (head, tail, bells), else anywhere.
      const size_t span = random() % 2 == 0 ? 256 : view.size() - 8;
      const size_t at = (random() % span + (span == 256 ? 64 : 0));
      const uint64_t word = random() % 4 == 0 ? random() : random() % 16384;
      std::memcpy(view.data() + (at & ~size_t{7}), &word, 8);
      absl::SleepFor(absl::Microseconds(50));
    }
  });
  int failed = 0;
  const absl::Time end = absl::Now() + absl::Milliseconds(300);
  for (int i = 0; absl::Now() < end; ++i) {
    const absl::Time deadline = absl::Now() + absl::Milliseconds(10);
    absl::StatusOr<std::string> response = (*caller)->Call(std::string(i % 700, 'c'), deadline);
    if (!response.ok()) ++failed;
    EXPECT_LT(absl::Now() - deadline, absl::Milliseconds(200));  // bounded by the deadline
  }
  done.store(true);
  scribbler.join();
  caller->reset();  // closed flag + ring
  (*server)->Stop();
  serving.join();
  EXPECT_GT(failed, 0);
}

}  // namespace
}  // namespace moe
