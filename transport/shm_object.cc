#include "transport/shm_object.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

absl::StatusCode CodeOf(int error_number) {
  switch (error_number) {
    case ENOENT:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case EEXIST:
      return absl::StatusCode::kAlreadyExists;
    case EINVAL:
    case ENAMETOOLONG:
    case EBADF:
    case ENODEV:
    case EISDIR:
      return absl::StatusCode::kInvalidArgument;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case EFBIG:
      return absl::StatusCode::kResourceExhausted;
    default:
      return absl::StatusCode::kInternal;
  }
}

// A POSIX name is "/" followed by 1..254 characters none of which is '/'.
absl::Status CheckName(absl::string_view name) {
  if (name.size() < 2 || name.size() > 255 || name[0] != '/' ||
      name.find('/', 1) != absl::string_view::npos || name.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory name \"", name, "\" is not \"/\" and 1-254 characters without \"/\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> SizeOf(int fd, absl::string_view what) {
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", what);
  if (st.st_size < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative size"));
  return static_cast<size_t>(st.st_size);
}

absl::Status Resize(int fd, size_t bytes, absl::string_view what) {
  if (bytes == 0 || bytes > static_cast<size_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": size ", bytes, " is out of range"));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) return ErrnoStatus(errno, "ftruncate", what);
  return absl::OkStatus();
}

}  // namespace

absl::Status ErrnoStatus(int error_number, absl::string_view call, absl::string_view what) {
  return absl::Status(CodeOf(error_number),
                      absl::StrCat(call, "(", what, "): ", std::strerror(error_number)));
}

ShmMapping& ShmMapping::operator=(ShmMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void ShmMapping::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

absl::StatusOr<ShmObject> ShmObject::CreateAnonymous(absl::string_view debug_name, size_t bytes) {
  const std::string name(debug_name);
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "memfd_create", name);
  ShmObject object(fd, 0, name, /*owns_name=*/false);
  if (absl::Status s = Resize(fd, bytes, name); !s.ok()) return s;
  object.size_ = bytes;
  return object;
}

absl::StatusOr<ShmObject> ShmObject::CreateNamed(absl::string_view name, size_t bytes) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  const std::string key(name);
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, "shm_open", key);
  ShmObject object(fd, 0, key, /*owns_name=*/true);  // unlinks on any failure below
  if (absl::Status s = Resize(fd, bytes, key); !s.ok()) return s;
  object.size_ = bytes;
  return object;
}

absl::StatusOr<ShmObject> ShmObject::OpenNamed(absl::string_view name) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  const std::string key(name);
  const int fd = shm_open(key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "shm_open", key);
  return Adopt(fd, key);
}

absl::StatusOr<ShmObject> ShmObject::OpenPath(absl::string_view path) {
  const std::string file(path);
  const int fd = open(file.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open", file);
  return Adopt(fd, file);
}

absl::StatusOr<ShmObject> ShmObject::Adopt(int fd, absl::string_view what) {
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": no file descriptor"));
  ShmObject object(fd, 0, std::string(what), /*owns_name=*/false);
  absl::StatusOr<size_t> size = SizeOf(fd, what);
  if (!size.ok()) return size.status();
  object.size_ = *size;
  return object;
}

ShmObject& ShmObject::operator=(ShmObject&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::exchange(other.fd_, -1);
    size_ = std::exchange(other.size_, 0);
    name_ = std::move(other.name_);
    owns_name_ = std::exchange(other.owns_name_, false);
  }
  return *this;
}

absl::StatusOr<ShmMapping> ShmObject::Map() const {
  if (fd_ < 0) return absl::FailedPreconditionError("Map of a closed shared-memory object");
  if (size_ == 0) return absl::InvalidArgumentError(absl::StrCat(name_, ": empty, nothing to map"));
  void* data = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (data == MAP_FAILED) return ErrnoStatus(errno, "mmap", name_);
  return ShmMapping(static_cast<char*>(data), size_);
}

absl::Status ShmObject::Unlink() {
  if (!owns_name_) return absl::OkStatus();
  owns_name_ = false;
  if (shm_unlink(name_.c_str()) != 0) return ErrnoStatus(errno, "shm_unlink", name_);
  return absl::OkStatus();
}

void ShmObject::Reset() {
  (void)Unlink();  // best effort in a destructor; Unlink() reports errors to those who ask
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  size_ = 0;
}

}  // namespace moe
