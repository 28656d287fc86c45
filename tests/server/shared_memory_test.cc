// moed's book of client shared-memory regions (server/shared_memory.h) without a cluster:
// which peers count as local, when a region's id is retired (unmapped on the workers), regions
// scoped to their owner, and moed's own objects refused by identity.
#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker_shm.h"

namespace moe {
namespace {

constexpr char kOwner[] = "token a";

TEST(IsLocalPeerTest, LoopbackAndUnixOnly) {
  EXPECT_TRUE(IsLocalPeer("ipv4:127.0.0.1:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv4:127.1.2.3:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::1]:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::ffff:127.0.0.1]:5000"));
  EXPECT_TRUE(IsLocalPeer("unix:/tmp/moed.sock"));
  EXPECT_FALSE(IsLocalPeer("ipv4:10.0.0.7:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv4:128.0.0.1:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[::ffff:10.0.0.1]:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[2001:db8::1]:5000"));
  EXPECT_FALSE(IsLocalPeer(""));
}

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    key_ = absl::StrCat("/moed-registry-test-", getpid());
    const int fd = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 4096), 0);
    close(fd);
  }
  void TearDown() override { shm_unlink(key_.c_str()); }
  std::string key_;
};

TEST_F(RegistryTest, UnregisterInUseRetiresWhenTheLastLeaseGoes) {
  SharedMemoryRegistry registry(absl::ZeroDuration());
  ASSERT_TRUE(registry.Register(kOwner, "r", key_, 0, 4096).ok());
  absl::StatusOr<ShmLease> a = registry.Acquire("x", kOwner, "r");
  absl::StatusOr<ShmLease> b = registry.Acquire("out", kOwner, "r");
  ASSERT_TRUE(a.ok() && b.ok());
  const uint64_t id = (*a)->id;
  EXPECT_EQ(registry.Status(kOwner, "r")->at(0).steps_in_flight, 2);
  ASSERT_TRUE(registry.Unregister(kOwner, "r").ok());
  EXPECT_EQ(registry.Acquire("x", kOwner, "r").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.TakeRetired().empty());  // still in use
  *a = ShmLease();
  EXPECT_TRUE(registry.TakeRetired().empty());
  *b = ShmLease();
  EXPECT_EQ(registry.TakeRetired(), std::vector<uint64_t>{id});
  EXPECT_TRUE(registry.TakeRetired().empty());  // once
  // The name is free again, under a new id.
  ASSERT_TRUE(registry.Register(kOwner, "r", key_, 0, 16).ok());
  EXPECT_NE(registry.Acquire("x", kOwner, "r").value()->id, id);
}

TEST_F(RegistryTest, UnlinkedObjectIsDropped) {
  SharedMemoryRegistry registry(absl::ZeroDuration());
  ASSERT_TRUE(registry.Register(kOwner, "r", key_, 0, 4096).ok());
  shm_unlink(key_.c_str());
  registry.DropStale(absl::Now());
  EXPECT_EQ(registry.Status(kOwner, "r").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.TakeRetired().size(), 1u);
}

TEST_F(RegistryTest, IdleRegionIsDroppedButNotWhileInUse) {
  SharedMemoryRegistry registry(absl::Seconds(10));
  ASSERT_TRUE(registry.Register(kOwner, "r", key_, 0, 4096).ok());
  absl::StatusOr<ShmLease> lease = registry.Acquire("x", kOwner, "r");
  registry.DropStale(absl::Now() + absl::Hours(1));  // in use: kept
  EXPECT_TRUE(registry.Status(kOwner, "r").ok());
  *lease = ShmLease();
  registry.DropStale(absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(registry.Status(kOwner, "r").ok());
  registry.DropStale(absl::Now() + absl::Hours(1));
  EXPECT_EQ(registry.Status(kOwner, "r").status().code(), absl::StatusCode::kNotFound);
}

// A CUDA region (RegisterCudaSharedMemory): its arguments are checked, it shares the names of
// POSIX regions, it has no object to go stale (only Unregister or idleness drop it), and a
// step's lease carries its handle.
TEST_F(RegistryTest, CudaRegionsAreCheckedAndShareTheNamespace) {
  SharedMemoryRegistry registry(absl::Seconds(10));
  const std::string handle(kCudaIpcHandleBytes, '\x5a');
  EXPECT_EQ(registry.RegisterCuda(kOwner, "g", std::string(63, 'h'), 0, 16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterCuda(kOwner, "g", "", 0, 16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterCuda(kOwner, "g", handle, -1, 16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterCuda(kOwner, "g", handle, 0, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterCuda(kOwner, "bad name", handle, 0, 16).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.RegisterCuda(kOwner, "g", handle, 1, 1 << 20).ok());
  ASSERT_TRUE(registry.Register(kOwner, "r", key_, 0, 4096).ok());
  EXPECT_EQ(registry.RegisterCuda(kOwner, "r", handle, 0, 16).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.Register(kOwner, "g", key_, 0, 16).code(), absl::StatusCode::kAlreadyExists);

  absl::StatusOr<ShmLease> lease = registry.Acquire("x_shm.region", kOwner, "g");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE((*lease)->cuda());
  EXPECT_EQ((*lease)->cuda_handle, handle);
  EXPECT_EQ((*lease)->cuda_device, 1);
  EXPECT_EQ((*lease)->byte_size, 1 << 20);
  *lease = ShmLease();

  shm_unlink(key_.c_str());  // the POSIX region goes stale, the CUDA one cannot
  registry.DropStale(absl::Now());
  EXPECT_EQ(registry.Status(kOwner, "r").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.Status(kOwner, "g").ok());
  registry.DropStale(absl::Now() + absl::Hours(1));  // idle
  EXPECT_EQ(registry.Status(kOwner, "g").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.TakeRetired().size(), 2u);
}

// Regions belong to their owner: another owner cannot list, lease or unregister them (NOT_FOUND
// as if absent), may register the same name, and "unregister all" takes only its own. CUDA
// regions share the namespace.
TEST_F(RegistryTest, RegionsAreScopedToTheirOwner) {
  SharedMemoryRegistry registry(absl::ZeroDuration());
  const std::string handle(kCudaIpcHandleBytes, 'h');
  ASSERT_TRUE(registry.Register("token a", "r", key_, 0, 4096).ok());
  ASSERT_TRUE(registry.RegisterCuda("token a", "g", handle, 0, 16).ok());
  EXPECT_EQ(registry.Status("token b", "r").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Status("token b", "g").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.Status("token b", "")->empty());
  EXPECT_EQ(registry.Acquire("x_shm.region", "token b", "r").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Acquire("x_shm.region", "token b", "g").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Unregister("token b", "r").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Unregister("token b", "g").code(), absl::StatusCode::kNotFound);
  // b's own "r" beside a's; "unregister all" of b leaves a's.
  ASSERT_TRUE(registry.Register("token b", "r", key_, 16, 16).ok());
  ASSERT_TRUE(registry.RegisterCuda("token b", "g", handle, 0, 32).ok());
  EXPECT_EQ(registry.Status("token b", "r")->at(0).region.offset, 16);
  EXPECT_EQ(registry.Status("token b", "g")->at(0).region.byte_size, 32);
  ASSERT_TRUE(registry.Unregister("token b", "").ok());
  EXPECT_TRUE(registry.Status("token b", "")->empty());
  absl::StatusOr<std::vector<ShmRegionStatus>> mine = registry.Status("token a", "");
  ASSERT_TRUE(mine.ok());
  ASSERT_EQ(mine->size(), 2u);
  EXPECT_EQ(mine->at(0).region.name, "g");
  EXPECT_EQ(mine->at(1).region.name, "r");
  EXPECT_EQ(mine->at(1).region.offset, 0);
  EXPECT_TRUE(registry.Acquire("x_shm.region", "token a", "r").ok());
}

// An object this process marked as its own (a relay buffer) is refused by what it is: under
// its name, and under a link made to it, PERMISSION_DENIED; once forgotten, registrable.
TEST_F(RegistryTest, OwnObjectsAreRefusedByIdentity) {
  struct stat st;
  const int fd = shm_open(key_.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fstat(fd, &st), 0);
  close(fd);
  const std::string link_key = key_ + "-link";
  ASSERT_EQ(link(("/dev/shm" + key_).c_str(), ("/dev/shm" + link_key).c_str()), 0);
  SharedMemoryRegistry registry(absl::ZeroDuration());
  MarkOwnShmObject(st.st_dev, st.st_ino);
  EXPECT_EQ(registry.Register(kOwner, "r", key_, 0, 16).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry.Register(kOwner, "r", link_key, 0, 16).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(registry.Status(kOwner, "")->empty());
  ForgetOwnShmObject(st.st_dev, st.st_ino);
  EXPECT_TRUE(registry.Register(kOwner, "r", link_key, 0, 16).ok());
  shm_unlink(link_key.c_str());
}

// A CPU worker refuses a step on a CUDA region with FAILED_PRECONDITION (moed refuses to
// register one with CPU workers; this is the worker's own guard).
TEST_F(RegistryTest, KeyWithANulByteIsRefusedNotTruncated) {
  SharedMemoryRegistry registry(absl::ZeroDuration());
  // shm_open would read key_ alone: an existing object under a name the caller did not send.
  absl::Status status =
      registry.Register(kOwner, "r", key_ + std::string(1, '\0') + "tail", 0, 4096);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("NUL"));
  EXPECT_TRUE(registry.Register(kOwner, "r", key_, 0, 4096).ok());
}

TEST(WorkerShmTest, CpuWorkerRefusesCudaRegions) {
  WorkerShmMappings mappings;
  internal::WorkerShmSlice slice;
  slice.set_region_id(7);
  slice.set_cuda_handle(std::string(kCudaIpcHandleBytes, '\x01'));
  slice.set_region_byte_size(64);
  slice.set_byte_size(64);
  v1::Tensor meta;
  meta.set_datatype("FP32");
  meta.add_shape(4);
  meta.add_shape(4);
  absl::StatusOr<ShmTensor> x = mappings.Input("x_shm", meta, slice);
  EXPECT_EQ(x.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(x.status().message()), ::testing::HasSubstr("needs CUDA workers"));
  EXPECT_EQ(mappings.mapped(), 0);
}

}  // namespace
}  // namespace moe
