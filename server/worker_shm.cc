#include "server/worker_shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/cuda/cuda_optional.h"
#include "engine/status_macros.h"

namespace moe {

// One region mapped: [base, base + length) covers the region's bytes from `region`.
struct WorkerShmMappings::Mapping {
  void* base = nullptr;
  size_t length = 0;
  char* region = nullptr;
  int64_t region_bytes = 0;
  int fd = -1;           // kept open: the size is checked again before every access
  bool pinned = false;   // page-locked for the GPU (unpinned before munmap)
  void* cuda = nullptr;  // a CUDA region opened by IPC (base, length unused)
  // The object as moed named it: region ids are unique for one moed only, and a worker
  // outlives a moed restart (the next moed hands out the same ids for other objects).
  std::string key;
  uint64_t device = 0, inode = 0;
  int64_t region_offset = 0;
  std::string cuda_handle;
  bool Names(const internal::WorkerShmSlice& slice) const {
    return key == slice.key() && device == slice.device() && inode == slice.inode() &&
           region_offset == slice.region_offset() && region_bytes == slice.region_byte_size() &&
           cuda_handle == slice.cuda_handle();
  }
  ~Mapping() {
    if (cuda != nullptr) {
      absl::Status status = OptionalCloseCudaIpcHandle(cuda);
      if (!status.ok()) {
        std::fprintf(stderr, "moe-worker: shared memory: closing a CUDA region: %s\n",
                     status.ToString().c_str());
      }
    }
    if (pinned) {
      absl::Status status = OptionalUnpinHostMemory(base);
      if (!status.ok()) {
        std::fprintf(stderr, "moe-worker: shared memory: unpinning a region: %s\n",
                     status.ToString().c_str());
      }
    }
    if (base != nullptr) munmap(base, length);
    if (fd >= 0) close(fd);
  }
};

WorkerShmMappings::~WorkerShmMappings() = default;

namespace {

absl::Status Errno(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::shared_ptr<WorkerShmMappings::Mapping>> WorkerShmMappings::MapSystem(
    absl::string_view field, const internal::WorkerShmSlice& slice) {
  auto made = std::make_shared<Mapping>();
  // A client's key is a POSIX shm name ("/name", no other "/": moed checked it); moed's own
  // relay buffers are anonymous memfds, named by the path of moed's descriptor
  // ("/proc/<moed>/fd/<fd>", server/relay_pool.h), which only moed's user can open.
  const bool path = slice.key().find('/', 1) != std::string::npos;
  made->fd = path ? open(slice.key().c_str(), O_RDWR | O_CLOEXEC)
                  : shm_open(slice.key().c_str(), O_RDWR | O_CLOEXEC, 0);
  if (made->fd < 0) {
    return Errno(absl::StrCat(field, path ? ": open(\"" : ": shm_open(\"", slice.key(), "\")"));
  }
  struct stat st;
  if (fstat(made->fd, &st) != 0) return Errno(absl::StrCat(field, ": fstat"));
  if (static_cast<uint64_t>(st.st_dev) != slice.device() ||
      static_cast<uint64_t>(st.st_ino) != slice.inode()) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": shm object \"", slice.key(),
        "\" on this worker is not the one registered with moed (worker on another host, or "
        "the object was replaced)"));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t start = slice.region_offset() / page * page;
  made->length = static_cast<size_t>(slice.region_offset() - start + slice.region_byte_size());
  void* base = mmap(nullptr, made->length, PROT_READ | PROT_WRITE, MAP_SHARED, made->fd, start);
  if (base == MAP_FAILED) return Errno(absl::StrCat(field, ": mmap(\"", slice.key(), "\")"));
  made->base = base;
  made->region = static_cast<char*>(base) + (slice.region_offset() - start);
  made->region_bytes = slice.region_byte_size();
  if (pin_for_cuda_) {
    // Once per mapping (cudaHostRegister costs ~ms per 100 MB): every later step's copies
    // between the region and the GPU then skip the staging buffers.
    absl::Status pinned = OptionalPinHostMemory(base, made->length);
    made->pinned = pinned.ok();
    static std::atomic<bool> warned{false};
    if (!pinned.ok() && !warned.exchange(true)) {
      std::fprintf(stderr,
                   "moe-worker: shared memory: cannot page-lock region \"%s\" for the GPU "
                   "(copies are staged instead): %s\n",
                   slice.key().c_str(), pinned.ToString().c_str());
    }
  }
  return made;
}

absl::StatusOr<std::shared_ptr<WorkerShmMappings::Mapping>> WorkerShmMappings::OpenCuda(
    absl::string_view field, const internal::WorkerShmSlice& slice) {
  const int device = cuda_device_.load();
  if (device < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": a CUDA shared-memory region needs CUDA workers; this worker runs on the CPU"));
  }
  absl::StatusOr<void*> opened = OptionalOpenCudaIpcHandle(
      slice.cuda_handle(), device, static_cast<size_t>(slice.region_byte_size()));
  if (!opened.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": CUDA region: ", opened.status().message()));
  }
  auto made = std::make_shared<Mapping>();
  made->cuda = *opened;
  made->region = static_cast<char*>(*opened);
  made->region_bytes = slice.region_byte_size();
  return made;
}

std::shared_ptr<WorkerShmMappings::Mapping> WorkerShmMappings::CachedLocked(
    const internal::WorkerShmSlice& slice) {
  auto it = mappings_.find(slice.region_id());
  if (it == mappings_.end()) return nullptr;
  if (it->second->Names(slice)) return it->second;
  // Another object under a known id (a mapping of a moed that was restarted): forget it; steps
  // still holding it keep it mapped until they are done.
  mappings_.erase(it);
  return nullptr;
}

absl::StatusOr<std::shared_ptr<WorkerShmMappings::Mapping>> WorkerShmMappings::Map(
    absl::string_view field, const internal::WorkerShmSlice& slice, char** bytes) {
  if (slice.offset() < 0 || slice.byte_size() < 0 ||
      slice.offset() > slice.region_byte_size() - slice.byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": slice [", slice.offset(), ", +",
                                                   slice.byte_size(), ") outside the region"));
  }
  std::shared_ptr<Mapping> mapping;
  {
    absl::MutexLock lock(&mu_);
    mapping = CachedLocked(slice);
    last_used_[slice.region_id()] = absl::Now();
  }
  if (mapping == nullptr) {
    // One opening at a time, and none twice (a CUDA IPC handle is opened once per process).
    absl::MutexLock opening(&open_mu_);
    {
      absl::MutexLock lock(&mu_);
      mapping = CachedLocked(slice);
    }
    if (mapping == nullptr) {
      if (slice.cuda_handle().empty()) {
        ASSIGN_OR_RETURN(mapping, MapSystem(field, slice));
      } else {
        ASSIGN_OR_RETURN(mapping, OpenCuda(field, slice));
      }
      mapping->key = slice.key();
      mapping->device = slice.device();
      mapping->inode = slice.inode();
      mapping->region_offset = slice.region_offset();
      mapping->cuda_handle = slice.cuda_handle();
      absl::MutexLock lock(&mu_);
      mappings_[slice.region_id()] = mapping;
    }
  }
  if (mapping->cuda != nullptr) {
    *bytes = mapping->region + slice.offset();
    return mapping;
  }
  // A client that shrank the object would make an access fault (SIGBUS): refuse instead.
  struct stat st;
  if (fstat(mapping->fd, &st) != 0) return Errno(absl::StrCat(field, ": fstat"));
  if (st.st_size < slice.region_offset() + slice.region_byte_size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": shm object \"", slice.key(), "\" was truncated below the region"));
  }
  *bytes = mapping->region + slice.offset();
  return mapping;
}

absl::StatusOr<ShmTensor> WorkerShmMappings::Input(absl::string_view field, const v1::Tensor& meta,
                                                   const internal::WorkerShmSlice& slice) {
  ASSIGN_OR_RETURN(DType dtype, ParseDType(meta.datatype()));
  std::vector<int64_t> shape(meta.shape().begin(), meta.shape().end());
  RETURN_IF_ERROR(CheckByteCount(field, dtype, shape, static_cast<size_t>(slice.byte_size())));
  char* bytes = nullptr;
  ASSIGN_OR_RETURN(std::shared_ptr<Mapping> mapping, Map(field, slice, &bytes));
  return ShmTensor{Tensor::View(dtype, std::move(shape), bytes), std::move(mapping)};
}

absl::StatusOr<ShmTensor> WorkerShmMappings::Output(absl::string_view field,
                                                    const std::vector<int64_t>& shape,
                                                    const internal::WorkerShmSlice& slice) {
  absl::StatusOr<DType> dtype = ParseDType(slice.datatype());
  if (!dtype.ok()) {
    return absl::InternalError(
        absl::StrCat(field, ": the output slice names no datatype (\"", slice.datatype(), "\")"));
  }
  if (!CheckByteCount(field, *dtype, shape, static_cast<size_t>(slice.byte_size())).ok()) {
    return absl::InternalError(absl::StrCat(field, ": the output slice holds ", slice.byte_size(),
                                            " bytes, not a ", DTypeName(*dtype), " [",
                                            absl::StrJoin(shape, ", "), "]"));
  }
  char* bytes = nullptr;
  ASSIGN_OR_RETURN(std::shared_ptr<Mapping> mapping, Map(field, slice, &bytes));
  return ShmTensor{Tensor::View(*dtype, shape, bytes), std::move(mapping)};
}

void WorkerShmMappings::Forget(const std::vector<uint64_t>& region_ids) {
  std::vector<std::shared_ptr<Mapping>> dropped;  // unmapped outside mu_
  absl::MutexLock lock(&mu_);
  for (uint64_t id : region_ids) {
    auto it = mappings_.find(id);
    if (it != mappings_.end()) {
      dropped.push_back(std::move(it->second));
      mappings_.erase(it);
    }
    last_used_.erase(id);
  }
}

void WorkerShmMappings::DropIdle(absl::Time now) {
  std::vector<std::shared_ptr<Mapping>> dropped;
  absl::MutexLock lock(&mu_);
  for (auto it = last_used_.begin(); it != last_used_.end();) {
    if (now - it->second <= idle_unmap_) {
      ++it;
      continue;
    }
    auto mapping = mappings_.find(it->first);
    if (mapping != mappings_.end()) {
      dropped.push_back(std::move(mapping->second));
      mappings_.erase(mapping);
    }
    it = last_used_.erase(it);
  }
}

int WorkerShmMappings::mapped() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(mappings_.size());
}

}  // namespace moe
