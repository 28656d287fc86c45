#include "server/relay_pool.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace moe {

namespace {

constexpr char kPrefix[] = "moed-relay-";
constexpr int64_t kSmallestBuffer = int64_t{1} << 20;

// The power of two >= bytes, at least kSmallestBuffer.
int64_t CapacityFor(int64_t bytes) {
  int64_t capacity = kSmallestBuffer;
  while (capacity < bytes) capacity <<= 1;
  return capacity;
}

// Unlinks "/dev/shm/moed-relay-<pid>-<n>" objects of processes that are gone: a killed moed of
// an earlier version, which named its buffers there (buffers are memfds now: nothing to leave).
void UnlinkOrphans() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* entry = readdir(dir)) {
    absl::string_view name = entry->d_name;
    if (!absl::ConsumePrefix(&name, kPrefix)) continue;
    std::vector<absl::string_view> parts = absl::StrSplit(name, '-');
    int pid = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &pid) || pid <= 0) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    shm_unlink(absl::StrCat("/", entry->d_name).c_str());
  }
  closedir(dir);
}

struct Mapped {
  std::string name;
  int fd = -1;  // the memfd, open while mapped: the workers open it as /proc/<moed>/fd/<fd>
  char* data = nullptr;
  int64_t capacity = 0;
  uint64_t device = 0, inode = 0;
};

}  // namespace

struct RelayPool::State {
  explicit State(int64_t max)
      : max_bytes(max), registry(absl::ZeroDuration(), kRelayFirstRegionId) {}
  ~State() {
    for (auto& [capacity, list] : free) {
      for (Mapped& m : list) Unmap(m);
    }
  }

  // A new buffer of `capacity` bytes: an anonymous memfd (no name anywhere a client could open
  // or link), backed (posix_fallocate: no memory is an error here, not a SIGBUS on first
  // write), mapped, marked as moed's own object (RegisterSystemSharedMemory refuses it by its
  // identity) and registered under "/proc/<moed>/fd/<fd>", the path the local workers open
  // (docs/SECURITY.md, "Shared memory").
  absl::StatusOr<Mapped> Create(int64_t capacity) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Mapped m;
    m.name = absl::StrCat(kPrefix, getpid(), "-", next_index++);
    const int fd = memfd_create(m.name.c_str(), MFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      close(fd);
      return absl::InternalError(absl::StrCat("fstat: ", std::strerror(err)));
    }
    const int rc = posix_fallocate(fd, 0, capacity);
    void* data =
        rc == 0 ? mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    const int map_errno = errno;
    if (data == MAP_FAILED) {
      close(fd);
      return absl::ResourceExhaustedError(absl::StrCat(
          rc != 0 ? "posix_fallocate: " : "mmap: ", std::strerror(rc != 0 ? rc : map_errno), " (",
          capacity, " bytes)"));
    }
    m.fd = fd;
    m.data = static_cast<char*>(data);
    m.capacity = capacity;
    m.device = static_cast<uint64_t>(st.st_dev);
    m.inode = static_cast<uint64_t>(st.st_ino);
    MarkOwnShmObject(m.device, m.inode);
    absl::Status registered = registry.RegisterOwn(
        m.name, absl::StrCat("/proc/", getpid(), "/fd/", fd), capacity, m.device, m.inode);
    if (!registered.ok()) {
      Close(m);
      return registered;
    }
    return m;
  }

  // Unmaps and closes: the memory is freed once no worker maps it any more.
  static void Close(const Mapped& m) {
    munmap(m.data, m.capacity);
    ForgetOwnShmObject(m.device, m.inode);
    close(m.fd);
  }

  void Unmap(const Mapped& m) {
    registry.Unregister("", m.name).IgnoreError();
    Close(m);
  }

  // Unmaps one kept buffer (the largest) to make room; false when none is kept.
  bool EvictOneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = free.rbegin(); it != free.rend(); ++it) {
      if (it->second.empty()) continue;
      Unmap(it->second.back());
      mapped -= it->second.back().capacity;
      it->second.pop_back();
      return true;
    }
    return false;
  }

  void Return(Mapped m, bool discard) {
    absl::MutexLock lock(&mu);
    if (discard) {
      mapped -= m.capacity;
      Unmap(m);
      return;
    }
    free[m.capacity].push_back(std::move(m));
  }

  const int64_t max_bytes;
  SharedMemoryRegistry registry;
  absl::Mutex mu;
  std::map<int64_t, std::vector<Mapped>> free ABSL_GUARDED_BY(mu);  // by capacity
  int64_t mapped ABSL_GUARDED_BY(mu) = 0;
  uint64_t next_index ABSL_GUARDED_BY(mu) = 0;
  bool warned ABSL_GUARDED_BY(mu) = false;
};

RelayPool::RelayPool(int64_t max_bytes) : state_(std::make_shared<State>(max_bytes)) {
  UnlinkOrphans();
}

RelayPool::~RelayPool() = default;

SharedMemoryRegistry* RelayPool::registry() { return &state_->registry; }

int64_t RelayPool::mapped_bytes() const {
  absl::MutexLock lock(&state_->mu);
  return state_->mapped;
}

std::shared_ptr<RelayBuffer> RelayPool::Take(int64_t bytes) {
  const int64_t capacity = CapacityFor(bytes);
  State& s = *state_;
  Mapped m;
  {
    absl::MutexLock lock(&s.mu);
    std::vector<Mapped>& kept = s.free[capacity];
    if (!kept.empty()) {
      m = std::move(kept.back());
      kept.pop_back();
    } else {
      while (s.mapped + capacity > s.max_bytes && s.EvictOneLocked()) {
      }
      if (s.mapped + capacity > s.max_bytes) return nullptr;
      absl::StatusOr<Mapped> created = s.Create(capacity);
      if (!created.ok()) {
        if (!s.warned) {
          std::fprintf(stderr,
                       "moed: relay buffers in shared memory unavailable (%s); steps "
                       "of local workers carry their tensors over gRPC\n",
                       created.status().ToString().c_str());
          s.warned = true;
        }
        return nullptr;
      }
      m = *std::move(created);
      s.mapped += capacity;
    }
  }
  auto* buffer = new RelayBuffer;
  buffer->name = m.name;
  buffer->data = m.data;
  buffer->capacity = m.capacity;
  std::shared_ptr<State> state = state_;
  return std::shared_ptr<RelayBuffer>(buffer, [state, m](RelayBuffer* b) {
    const bool discard = b->discard.load();
    delete b;
    state->Return(m, discard);
  });
}

grpc::Slice RelaySlice(std::shared_ptr<RelayBuffer> buffer, int64_t bytes) {
  char* data = buffer->data;
  auto* hold = new std::shared_ptr<RelayBuffer>(std::move(buffer));
  return grpc::Slice(
      data, static_cast<size_t>(bytes),
      [](void* p) { delete static_cast<std::shared_ptr<RelayBuffer>*>(p); }, hold);
}

}  // namespace moe
