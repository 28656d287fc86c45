#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/layer_info.h"

namespace moe {
namespace {

constexpr size_t kMaxKeyLength = 251;  // "/" + NAME_MAX - 4 (glibc's "/dev/shm/" prefix)

absl::Status CheckKey(const std::string& key) {
  if (key.size() < 2 || key.size() > kMaxKeyLength || key[0] != '/' ||
      key.find('/', 1) != std::string::npos || key.find('\0') != std::string::npos || key == "/." ||
      key == "/..") {
    return absl::InvalidArgumentError(
        absl::StrCat("key: \"", key,
                     "\" is not a POSIX shm name (\"/\" then 1-250 characters, no \"/\" or NUL)"));
  }
  return absl::OkStatus();
}

// The object's identity and size, or NOT_FOUND / PERMISSION_DENIED / INTERNAL.
absl::StatusOr<struct stat> StatObject(const std::string& key, int flags) {
  const int fd = shm_open(key.c_str(), flags | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string what = absl::StrCat("key: shm_open(\"", key, "\"): ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(what);
    if (err == EACCES) return absl::PermissionDeniedError(what);
    return absl::InternalError(what);
  }
  struct stat st;
  const int rc = fstat(fd, &st);
  const int err = errno;
  close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("key: fstat: ", std::strerror(err)));
  return st;
}

// Same object as registered (an unlinked or replaced one is not). A CUDA region has no object
// moed can look at: it stays until unregistered or idle.
bool SameObject(const ShmRegion& region) {
  if (region.cuda() || region.own) return true;
  absl::StatusOr<struct stat> st = StatObject(region.key, O_RDONLY);
  return st.ok() && static_cast<uint64_t>(st->st_dev) == region.device &&
         static_cast<uint64_t>(st->st_ino) == region.inode;
}

absl::Mutex own_objects_mu(absl::kConstInit);
std::set<std::pair<uint64_t, uint64_t>>& OwnObjects()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(own_objects_mu) {
  static auto* objects = new std::set<std::pair<uint64_t, uint64_t>>;
  return *objects;
}

std::string NotFound(const std::string& name) {
  return absl::StrCat("name: no shared-memory region \"", name, "\"");
}

}  // namespace

void MarkOwnShmObject(uint64_t device, uint64_t inode) {
  absl::MutexLock lock(&own_objects_mu);
  OwnObjects().insert({device, inode});
}

void ForgetOwnShmObject(uint64_t device, uint64_t inode) {
  absl::MutexLock lock(&own_objects_mu);
  OwnObjects().erase({device, inode});
}

bool IsOwnShmObject(uint64_t device, uint64_t inode) {
  absl::MutexLock lock(&own_objects_mu);
  return OwnObjects().count({device, inode}) != 0;
}

bool IsLocalPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "ipv4:127.") ||
         absl::StartsWith(peer, "ipv6:[::1]:") || absl::StartsWith(peer, "ipv6:[::ffff:127.");
}

ShmLease& ShmLease::operator=(ShmLease&& other) noexcept {
  if (this != &other) {
    Release();
    registry_ = other.registry_;
    region_ = std::move(other.region_);
    other.registry_ = nullptr;
  }
  return *this;
}

void ShmLease::Release() {
  if (region_ != nullptr && registry_ != nullptr) registry_->Release(*region_);
  region_.reset();
  registry_ = nullptr;
}

absl::Status SharedMemoryRegistry::Register(const std::string& owner, const std::string& name,
                                            const std::string& key, int64_t offset,
                                            int64_t byte_size) {
  absl::Status name_ok = ValidateLayerName("name", name);
  if (!name_ok.ok()) return name_ok;
  absl::Status key_ok = CheckKey(key);
  if (!key_ok.ok()) return key_ok;
  if (offset < 0) return absl::InvalidArgumentError(absl::StrCat("offset: ", offset, " < 0"));
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size: ", byte_size, " <= 0"));
  }
  if (offset > INT64_MAX - byte_size) {
    return absl::InvalidArgumentError("offset + byte_size: overflows int64");
  }
  // Read-write: the workers write outputs into it with moed's user.
  absl::StatusOr<struct stat> st = StatObject(key, O_RDWR);
  if (!st.ok()) return st.status();
  // By identity, not by name: a link or any other path to one of moed's relay buffers (which
  // hold other callers' tensors) is the same object.
  if (IsOwnShmObject(static_cast<uint64_t>(st->st_dev), static_cast<uint64_t>(st->st_ino))) {
    return absl::PermissionDeniedError(
        absl::StrCat("key: shm object \"", key,
                     "\" is one of moed's own buffers; register an object you created"));
  }
  if (st->st_size < offset + byte_size) {
    return absl::InvalidArgumentError(absl::StrCat("offset + byte_size: ", offset + byte_size,
                                                   " > the size of shm object \"", key, "\" (",
                                                   static_cast<int64_t>(st->st_size), " bytes)"));
  }
  auto region = std::make_shared<ShmRegion>();
  region->owner = owner;
  region->name = name;
  region->key = key;
  region->offset = offset;
  region->byte_size = byte_size;
  region->device = static_cast<uint64_t>(st->st_dev);
  region->inode = static_cast<uint64_t>(st->st_ino);
  return Insert(std::move(region));
}

absl::Status SharedMemoryRegistry::RegisterCuda(const std::string& owner, const std::string& name,
                                                const std::string& raw_handle, int64_t device_id,
                                                int64_t byte_size) {
  absl::Status name_ok = ValidateLayerName("name", name);
  if (!name_ok.ok()) return name_ok;
  if (raw_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle: ", raw_handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ",
                                                   kCudaIpcHandleBytes));
  }
  if (device_id < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device_id: ", device_id, " < 0"));
  }
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size: ", byte_size, " <= 0"));
  }
  auto region = std::make_shared<ShmRegion>();
  region->owner = owner;
  region->name = name;
  region->byte_size = byte_size;
  region->cuda_handle = raw_handle;
  region->cuda_device = device_id;
  return Insert(std::move(region));
}

absl::Status SharedMemoryRegistry::RegisterOwn(const std::string& name, const std::string& key,
                                               int64_t byte_size, uint64_t device, uint64_t inode) {
  auto region = std::make_shared<ShmRegion>();
  region->name = name;
  region->key = key;
  region->byte_size = byte_size;
  region->device = device;
  region->inode = inode;
  region->own = true;
  return Insert(std::move(region));
}

absl::Status SharedMemoryRegistry::Insert(std::shared_ptr<ShmRegion> region) {
  const Key key(region->owner, region->name);
  absl::MutexLock lock(&mu_);
  if (by_name_.count(key) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: region \"", region->name, "\" is registered (unregister it first)"));
  }
  region->id = next_id_++;
  by_name_[key] = region->id;
  Entry& entry = entries_[region->id];
  entry.region = std::move(region);
  entry.last_used = absl::Now();
  return absl::OkStatus();
}

void SharedMemoryRegistry::DropLocked(const Key& key, const char* why) {
  const std::string& name = key.second;
  auto it = by_name_.find(key);
  if (it == by_name_.end()) return;
  const uint64_t id = it->second;
  by_name_.erase(it);
  Entry& entry = entries_[id];
  entry.dropped = true;
  if (why != nullptr) {
    std::fprintf(stderr, "moed: shared-memory region %s (%s) dropped: %s\n", name.c_str(),
                 entry.region->cuda() ? "CUDA IPC" : entry.region->key.c_str(), why);
  }
  if (entry.in_flight == 0) {
    entries_.erase(id);
    retired_.push_back(id);
  }
}

absl::Status SharedMemoryRegistry::Unregister(const std::string& owner, const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (name.empty()) {
    std::vector<Key> owned;
    for (auto it = by_name_.lower_bound(Key(owner, ""));
         it != by_name_.end() && it->first.first == owner; ++it) {
      owned.push_back(it->first);
    }
    for (const Key& key : owned) DropLocked(key, nullptr);
    return absl::OkStatus();
  }
  const Key key(owner, name);
  if (by_name_.count(key) == 0) return absl::NotFoundError(NotFound(name));
  DropLocked(key, nullptr);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ShmRegionStatus>> SharedMemoryRegistry::Status(const std::string& owner,
                                                                          const std::string& name) {
  DropStale(absl::Now());
  absl::MutexLock lock(&mu_);
  std::vector<ShmRegionStatus> out;
  for (auto it = by_name_.lower_bound(Key(owner, ""));
       it != by_name_.end() && it->first.first == owner; ++it) {
    if (!name.empty() && it->first.second != name) continue;
    const Entry& entry = entries_.at(it->second);
    out.push_back(ShmRegionStatus{*entry.region, entry.in_flight});
  }
  if (!name.empty() && out.empty()) return absl::NotFoundError(NotFound(name));
  return out;
}

absl::StatusOr<ShmLease> SharedMemoryRegistry::Acquire(absl::string_view field,
                                                       const std::string& owner,
                                                       const std::string& name) {
  const Key key(owner, name);
  std::shared_ptr<const ShmRegion> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_name_.find(key);
    if (it != by_name_.end()) region = entries_.at(it->second).region;
  }
  if (region == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(field, ": no shared-memory region \"", name, "\" is registered"));
  }
  // Outside mu_: a syscall per step keeps a dead client's unlinked object from being used.
  const bool same = SameObject(*region);
  absl::MutexLock lock(&mu_);
  auto it = by_name_.find(key);
  if (it == by_name_.end() || it->second != region->id) {
    return absl::NotFoundError(
        absl::StrCat(field, ": shared-memory region \"", name, "\" was unregistered"));
  }
  if (!same) {
    DropLocked(key, "its shm object was unlinked or replaced");
    return absl::NotFoundError(absl::StrCat(field, ": shared-memory region \"", name,
                                            "\" was dropped: its shm object \"", region->key,
                                            "\" was unlinked or replaced"));
  }
  Entry& entry = entries_.at(region->id);
  ++entry.in_flight;
  entry.last_used = absl::Now();
  ShmLease lease;
  lease.registry_ = this;
  lease.region_ = entry.region;
  return lease;
}

void SharedMemoryRegistry::Release(const ShmRegion& region) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(region.id);
  if (it == entries_.end()) return;
  it->second.last_used = absl::Now();
  if (--it->second.in_flight == 0 && it->second.dropped) {
    entries_.erase(it);
    retired_.push_back(region.id);
  }
}

void SharedMemoryRegistry::DropStale(absl::Time now) {
  std::vector<std::shared_ptr<const ShmRegion>> regions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, id] : by_name_) regions.push_back(entries_.at(id).region);
  }
  std::vector<bool> same;
  for (const auto& region : regions) same.push_back(SameObject(*region));
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < regions.size(); ++i) {
    const Key key(regions[i]->owner, regions[i]->name);
    auto it = by_name_.find(key);
    if (it == by_name_.end() || it->second != regions[i]->id) continue;
    const Entry& entry = entries_.at(it->second);
    if (!same[i]) {
      DropLocked(key, "its shm object was unlinked or replaced");
    } else if (idle_timeout_ > absl::ZeroDuration() && entry.in_flight == 0 &&
               now - entry.last_used > idle_timeout_) {
      DropLocked(key, "unused for --shm_idle_timeout_s");
    }
  }
}

std::vector<uint64_t> SharedMemoryRegistry::TakeRetired() {
  absl::MutexLock lock(&mu_);
  return std::exchange(retired_, {});
}

}  // namespace moe
