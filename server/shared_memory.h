// moed's book of client shared-memory regions (RegisterSystemSharedMemory, proto/moe.proto):
// (owner, name) -> (POSIX shm key, offset, byte size, the object's identity), with a reference
// count of the steps using each region. The owner is the caller's identity
// (MoeServiceImpl::ShmOwnerOf: its token with --tokens_file, one identity without): a caller
// lists, uses and unregisters its own regions only; another's are NOT_FOUND, as if absent.
// moed never maps a client region; the workers do (server/worker_shm.h), and forget a region
// once its id is retired here.
//
// Objects moed made itself (its relay buffers, server/relay_pool.h) are marked by identity
// (MarkOwnShmObject): Register refuses them with PERMISSION_DENIED whatever path names them.
//
// Lifetime of a region: Register -> Acquire/release by steps -> Unregister (or DropStale) takes
// it off the book at once; its id is retired (TakeRetired) when the last step that acquired
// it has released it, so a worker is told to unmap it only when no step can still use it.
//
//   SharedMemoryRegistry registry(absl::Seconds(600));
//   RETURN_IF_ERROR(registry.Register(owner, "in", "/my_shm", 0, 1 << 20));
//   ASSIGN_OR_RETURN(ShmLease lease, registry.Acquire("x_shm.region", owner, "in"));
//   ... lease->key, lease->id ...
//   lease = {};                                   // the step ended
//   for (uint64_t id : registry.TakeRetired()) ...  // tell the workers to unmap
#ifndef MOED_SERVER_SHARED_MEMORY_H_
#define MOED_SERVER_SHARED_MEMORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moe {

// Bytes of a cudaIpcMemHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;

// A registered region: bytes [offset, offset + byte_size) of the shm object `key`, which was
// the object (device, inode) when it was registered; or, for a CUDA region, the first
// byte_size bytes of the GPU allocation shared by `cuda_handle`.
struct ShmRegion {
  std::string owner;  // who registered it (MoeServiceImpl::ShmOwnerOf)
  std::string name;
  std::string key;
  int64_t offset = 0;
  int64_t byte_size = 0;
  uint64_t id = 0;  // unique for the registry's lifetime
  uint64_t device = 0;
  uint64_t inode = 0;
  std::string cuda_handle;   // a cudaIpcMemHandle_t; empty for a POSIX region
  int64_t cuda_device = -1;  // the client's device ordinal (informational)
  bool own = false;          // moed's own object (RegisterOwn): never stale, never checked
  bool cuda() const { return !cuda_handle.empty(); }
};

struct ShmRegionStatus {
  ShmRegion region;
  int64_t steps_in_flight = 0;
};

class SharedMemoryRegistry;

// A step's use of a region (move-only): the region stays mapped on the workers until every
// lease of it is gone, also when it was unregistered meanwhile.
class ShmLease {
 public:
  ShmLease() = default;
  ShmLease(ShmLease&& other) noexcept { *this = std::move(other); }
  ShmLease& operator=(ShmLease&& other) noexcept;
  ~ShmLease() { Release(); }
  const ShmRegion* operator->() const { return region_.get(); }
  const ShmRegion& operator*() const { return *region_; }
  explicit operator bool() const { return region_ != nullptr; }

 private:
  friend class SharedMemoryRegistry;
  void Release();
  SharedMemoryRegistry* registry_ = nullptr;
  std::shared_ptr<const ShmRegion> region_;
};

// The peer string of a gRPC call is on this host: "unix:...", "ipv4:127.x.x.x:port",
// "ipv6:[::1]:port" or an IPv4-mapped loopback "ipv6:[::ffff:127.x.x.x]:port".
bool IsLocalPeer(absl::string_view peer);

// The identities (st_dev, st_ino) of the shared-memory objects this process created and still
// holds (its relay buffers): Register refuses them. Thread-safe.
void MarkOwnShmObject(uint64_t device, uint64_t inode);
void ForgetOwnShmObject(uint64_t device, uint64_t inode);
bool IsOwnShmObject(uint64_t device, uint64_t inode);

// Thread-safe.
class SharedMemoryRegistry {
 public:
  // idle_timeout: a region no step has used for this long is dropped by DropStale (zero:
  // never).
  // first_id: the first region id handed out; registries whose regions reach the same workers
  // start at ids far apart, since the workers cache mappings by id (moed's relay buffers,
  // server/relay_pool.h, start at kRelayFirstRegionId).
  explicit SharedMemoryRegistry(absl::Duration idle_timeout, uint64_t first_id = 1)
      : idle_timeout_(idle_timeout), next_id_(first_id) {}

  // Checks the name, key and range, opens the object (read-write) to check that it exists and
  // is large enough, and records its identity. Codes as RegisterSystemSharedMemoryRequest;
  // PERMISSION_DENIED for one of this process's own objects (IsOwnShmObject). Names are
  // per owner: another owner may register the same name.
  absl::Status Register(const std::string& owner, const std::string& name, const std::string& key,
                        int64_t offset, int64_t byte_size);
  // A CUDA region (RegisterCudaSharedMemoryRequest): checks the name, the handle's size, the
  // device ordinal and the size (INVALID_ARGUMENT); moed cannot open it (the workers do).
  // Such a region is dropped only by Unregister or idle_timeout. Same namespace as Register.
  absl::Status RegisterCuda(const std::string& owner, const std::string& name,
                            const std::string& raw_handle, int64_t device_id, int64_t byte_size);
  // One of moed's own objects (a relay buffer), owner "": the whole of it, `key` the path the
  // workers open, the identity as moed's fstat gave it. Never dropped as stale.
  absl::Status RegisterOwn(const std::string& name, const std::string& key, int64_t byte_size,
                           uint64_t device, uint64_t inode);
  // Takes owner's `name` (empty: every region of owner) off the book; NOT_FOUND if owner has
  // no such region.
  absl::Status Unregister(const std::string& owner, const std::string& name);
  // owner's `name` (empty: all of owner's, by name); NOT_FOUND if owner has no such region.
  // Drops stale regions first.
  absl::StatusOr<std::vector<ShmRegionStatus>> Status(const std::string& owner,
                                                      const std::string& name);
  // For a step: NOT_FOUND (naming `field`) when owner has no such region, or when its object
  // was unlinked or replaced (then the region is dropped).
  absl::StatusOr<ShmLease> Acquire(absl::string_view field, const std::string& owner,
                                   const std::string& name);
  // Drops regions whose object is gone or replaced, and regions idle past idle_timeout.
  void DropStale(absl::Time now);
  // Ids of dropped regions that no step uses any more (each returned once).
  std::vector<uint64_t> TakeRetired();

 private:
  friend class ShmLease;
  struct Entry {
    std::shared_ptr<const ShmRegion> region;
    int64_t in_flight = 0;
    bool dropped = false;
    absl::Time last_used;
  };
  void Release(const ShmRegion& region);
  using Key = std::pair<std::string, std::string>;  // owner, name
  // Books a new region under (owner, name) (ALREADY_EXISTS if taken) with a new id.
  absl::Status Insert(std::shared_ptr<ShmRegion> region);
  // Removes the entry from by_name_; its id retires now or when its last lease is released.
  void DropLocked(const Key& key, const char* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration idle_timeout_;
  absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_);
  std::map<Key, uint64_t> by_name_ ABSL_GUARDED_BY(mu_);          // (owner, name) -> id
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);        // registered or leased
  std::vector<uint64_t> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_SHARED_MEMORY_H_
