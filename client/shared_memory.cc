#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {
namespace client {

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(
    const std::string& key, size_t byte_size) {
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const std::string what = absl::StrCat("shm_open(\"", key, "\"): ", std::strerror(errno));
    return errno == EEXIST ? absl::AlreadyExistsError(what) : absl::InternalError(what);
  }
  if (ftruncate(fd, static_cast<off_t>(byte_size)) != 0) {
    const std::string what = absl::StrCat("ftruncate(\"", key, "\"): ", std::strerror(errno));
    close(fd);
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(what);
  }
  void* base = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::InternalError(absl::StrCat("mmap(\"", key, "\"): ", std::strerror(err)));
  }
  return std::unique_ptr<SharedMemoryRegion>(new SharedMemoryRegion(key, base, byte_size));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(base_, size_);
  shm_unlink(key_.c_str());
}

}  // namespace client
}  // namespace moe
