// moed's relay buffers (server/relay_pool.h) without a cluster: sizes, reuse, the cap,
// eviction, discarded buffers, slices that hold a buffer, and objects a killed moed left.
#include "server/relay_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

bool Exists(const std::string& name) {
  struct stat st;
  return stat(("/dev/shm/" + name).c_str(), &st) == 0;
}

// The leased region of `buffer`: its key (the path workers open) and identity.
ShmRegion RegionOf(RelayPool& pool, const RelayBuffer& buffer) {
  absl::StatusOr<ShmLease> lease = pool.registry()->Acquire("x", "", buffer.name);
  EXPECT_TRUE(lease.ok()) << lease.status();
  return lease.ok() ? **lease : ShmRegion();
}

TEST(RelayPoolTest, SizesInPowersOfTwoAndReusesReleasedBuffers) {
  RelayPool pool(64 * kMiB);
  std::shared_ptr<RelayBuffer> a = pool.Take(1000);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->capacity, kMiB);
  EXPECT_EQ(a->name.rfind(absl::StrCat("moed-relay-", getpid(), "-"), 0), 0u) << a->name;
  EXPECT_FALSE(Exists(a->name));  // a memfd: no name in /dev/shm
  a->data[kMiB - 1] = 7;  // backed: writing the last byte does not fault
  std::shared_ptr<RelayBuffer> b = pool.Take(3 * kMiB);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->capacity, 4 * kMiB);
  EXPECT_EQ(pool.mapped_bytes(), 5 * kMiB);
  const std::string a_name = a->name;
  a.reset();
  std::shared_ptr<RelayBuffer> again = pool.Take(kMiB);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->name, a_name);  // the kept buffer, not a new object
  EXPECT_EQ(pool.mapped_bytes(), 5 * kMiB);
  // Registered under its name, for leases.
  EXPECT_TRUE(pool.registry()->Acquire("x", "", again->name).ok());
}

TEST(RelayPoolTest, CapRefusesThenEvictsKeptBuffers) {
  RelayPool pool(2 * kMiB);
  std::shared_ptr<RelayBuffer> a = pool.Take(kMiB);
  std::shared_ptr<RelayBuffer> b = pool.Take(kMiB);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(pool.Take(1), nullptr);  // both in use: the step goes over gRPC
  const std::string a_name = a->name, b_name = b->name;
  a.reset();
  b.reset();
  // Two kept 1 MiB buffers make room for a 2 MiB one.
  std::shared_ptr<RelayBuffer> big = pool.Take(2 * kMiB);
  ASSERT_NE(big, nullptr);
  EXPECT_FALSE(pool.registry()->Acquire("x", "", a_name).ok());
  EXPECT_FALSE(pool.registry()->Acquire("x", "", b_name).ok());
  EXPECT_EQ(pool.mapped_bytes(), 2 * kMiB);
  EXPECT_EQ(pool.Take(3 * kMiB), nullptr);  // larger than the cap
}

TEST(RelayPoolTest, DiscardedBufferIsUnlinkedNotReused) {
  RelayPool pool(8 * kMiB);
  std::shared_ptr<RelayBuffer> a = pool.Take(kMiB);
  ASSERT_NE(a, nullptr);
  const std::string name = a->name;
  RelayStep step;
  step.input = a;
  EXPECT_TRUE(step.DiscardIfFailed(absl::OkStatus()).ok());
  EXPECT_FALSE(a->discard);
  EXPECT_EQ(step.DiscardIfFailed(absl::DeadlineExceededError("late")).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(a->discard);
  a.reset();
  step = RelayStep();
  EXPECT_EQ(pool.mapped_bytes(), 0);
  EXPECT_FALSE(pool.registry()->Acquire("x", "", name).ok());
}

TEST(RelayPoolTest, SliceHoldsItsBufferUntilGrpcReleasesIt) {
  RelayPool pool(8 * kMiB);
  std::shared_ptr<RelayBuffer> a = pool.Take(kMiB);
  ASSERT_NE(a, nullptr);
  std::memcpy(a->data, "relay", 5);
  const std::string name = a->name;
  auto slice = std::make_unique<grpc::Slice>(RelaySlice(a, 5));
  a.reset();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(slice->begin()), slice->size()), "relay");
  std::shared_ptr<RelayBuffer> other = pool.Take(kMiB);
  ASSERT_NE(other, nullptr);
  EXPECT_NE(other->name, name);  // still held by the slice
  slice.reset();
  other.reset();
  EXPECT_EQ(pool.mapped_bytes(), 2 * kMiB);  // both kept for reuse
}

// A buffer is an anonymous memfd: the workers open it as /proc/<moed>/fd/<fd>, it has no name a
// client could open, and while it is mapped its identity is moed's own (refused by
// RegisterSystemSharedMemory); once closed it is no longer.
TEST(RelayPoolTest, BuffersAreAnonymousAndMarkedAsOwn) {
  RelayPool pool(8 * kMiB);
  std::shared_ptr<RelayBuffer> a = pool.Take(kMiB);
  ASSERT_NE(a, nullptr);
  const ShmRegion region = RegionOf(pool, *a);
  EXPECT_EQ(region.key.rfind(absl::StrCat("/proc/", getpid(), "/fd/"), 0), 0u) << region.key;
  struct stat st;
  ASSERT_EQ(stat(region.key.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_ino), region.inode);
  EXPECT_EQ(static_cast<uint64_t>(st.st_dev), region.device);
  EXPECT_EQ(st.st_nlink, 0u);  // nothing links it: no path but moed's descriptor
  EXPECT_TRUE(IsOwnShmObject(region.device, region.inode));
  EXPECT_EQ(shm_open(("/" + a->name).c_str(), O_RDWR, 0), -1);
  a->discard = true;
  a.reset();
  EXPECT_FALSE(IsOwnShmObject(region.device, region.inode));
}

TEST(RelayPoolTest, UnlinksObjectsOfDeadProcessesOnly) {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // its pid names no process now
  const std::string dead = absl::StrCat("moed-relay-", child, "-0");
  const std::string alive = absl::StrCat("moed-relay-", getppid(), "-12345");
  for (const std::string& name : {dead, alive}) {
    const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << name;
    close(fd);
  }
  RelayPool pool(kMiB);
  EXPECT_FALSE(Exists(dead));
  EXPECT_TRUE(Exists(alive));
  shm_unlink(("/" + alive).c_str());
}

}  // namespace
}  // namespace moe
