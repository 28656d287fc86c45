#include "server/worker_shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {

// One region mapped: [base, base + length) covers the region's bytes from `region`.
struct WorkerShmMappings::Mapping {
  void* base = nullptr;
  size_t length = 0;
  char* region = nullptr;
  int64_t region_bytes = 0;
  int fd = -1;  // kept open: the size is checked again before every access
  ~Mapping() {
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
    auto it = mappings_.find(slice.region_id());
    if (it != mappings_.end()) mapping = it->second;
    last_used_[slice.region_id()] = absl::Now();
  }
  if (mapping == nullptr) {
    auto made = std::make_shared<Mapping>();
    made->fd = shm_open(slice.key().c_str(), O_RDWR | O_CLOEXEC, 0);
    if (made->fd < 0) return Errno(absl::StrCat(field, ": shm_open(\"", slice.key(), "\")"));
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
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = mappings_.emplace(slice.region_id(), made);
    mapping = it->second;  // another call may have mapped it meanwhile: use that one
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

absl::StatusOr<Tensor> WorkerShmMappings::Read(absl::string_view field, const v1::Tensor& meta,
                                               const internal::WorkerShmSlice& slice) {
  ASSIGN_OR_RETURN(DType dtype, ParseDType(meta.datatype()));
  std::vector<int64_t> shape(meta.shape().begin(), meta.shape().end());
  RETURN_IF_ERROR(CheckByteCount(field, dtype, shape, static_cast<size_t>(slice.byte_size())));
  char* bytes = nullptr;
  ASSIGN_OR_RETURN(std::shared_ptr<Mapping> mapping, Map(field, slice, &bytes));
  Tensor tensor = Tensor::Uninitialized(dtype, std::move(shape));
  if (tensor.num_bytes() > 0) std::memcpy(tensor.raw(), bytes, tensor.num_bytes());
  return tensor;
}

absl::Status WorkerShmMappings::Write(const Tensor& tensor, const internal::WorkerShmSlice& slice,
                                      v1::Tensor* meta) {
  if (static_cast<int64_t>(tensor.num_bytes()) != slice.byte_size()) {
    return absl::InternalError(absl::StrCat("output slice holds ", slice.byte_size(),
                                            " bytes, the output has ", tensor.num_bytes()));
  }
  char* bytes = nullptr;
  ASSIGN_OR_RETURN(std::shared_ptr<Mapping> mapping, Map("output", slice, &bytes));
  if (tensor.num_bytes() > 0) std::memcpy(bytes, tensor.raw(), tensor.num_bytes());
  meta->set_datatype(DTypeName(tensor.dtype()));
  meta->clear_shape();
  for (int64_t d : tensor.shape()) meta->add_shape(d);
  meta->clear_raw_data();
  return absl::OkStatus();
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
