// ShmObject: the one shared-memory primitive of the project (issue 38 §1). A shared-memory
// object (an fd plus its byte size) that is created, opened and mapped here and nowhere else;
// ShmMapping is one read-write MAP_SHARED view of it. Both are RAII and move-only: the fd is
// closed, the view unmapped, a name this process created and still holds is unlinked.
//
// This is the intended home of every shared-memory region the project maps: client/ and
// server/ (client/shared_memory.cc, server/worker_shm.cc, server/relay_pool.cc) still open
// and map theirs by hand and move here once their owners are done editing them.
//
//   ASSIGN_OR_RETURN(ShmObject object, ShmObject::CreateNamed(name, 1 << 20));
//   ... hand `name` to the peer; once it has opened it:
//   RETURN_IF_ERROR(object.Unlink());            // nothing left in /dev/shm
//   ASSIGN_OR_RETURN(ShmMapping view, object.Map());
//   std::memcpy(view.data(), bytes, n);
//
// errno becomes an absl::Status with the code a caller can act on: ENOENT NOT_FOUND, EACCES /
// EPERM PERMISSION_DENIED, EEXIST ALREADY_EXISTS, EINVAL / ENAMETOOLONG and bad arguments
// INVALID_ARGUMENT, ENOMEM / ENOSPC / EMFILE RESOURCE_EXHAUSTED; the message names the call,
// the object and strerror.
#ifndef MOED_TRANSPORT_SHM_OBJECT_H_
#define MOED_TRANSPORT_SHM_OBJECT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

// errno of `call` on `what` as a Status (the mapping above).
absl::Status ErrnoStatus(int error_number, absl::string_view call, absl::string_view what);

class ShmMapping {
 public:
  ShmMapping() = default;
  ShmMapping(ShmMapping&& other) noexcept { *this = std::move(other); }
  ShmMapping& operator=(ShmMapping&& other) noexcept;
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  ~ShmMapping() { Reset(); }

  char* data() const { return data_; }
  size_t size() const { return size_; }
  void Reset();  // unmaps now

 private:
  friend class ShmObject;
  ShmMapping(char* data, size_t size) : data_(data), size_(size) {}
  char* data_ = nullptr;
  size_t size_ = 0;
};

class ShmObject {
 public:
  // A new anonymous object (memfd_create, close-on-exec) of `bytes` zero bytes; `debug_name`
  // only shows in /proc/PID/fd. A peer opens it through fd passing or /proc/PID/fd/N.
  static absl::StatusOr<ShmObject> CreateAnonymous(absl::string_view debug_name, size_t bytes);
  // A new POSIX object "/name" (shm_open O_CREAT|O_EXCL, mode 0600) of `bytes` zero bytes, for
  // a peer that is given the name. ALREADY_EXISTS if the name is taken. The name is unlinked
  // by Unlink() (call it as soon as the peer has opened it) or at the latest by the destructor.
  static absl::StatusOr<ShmObject> CreateNamed(absl::string_view name, size_t bytes);
  // Opens an existing POSIX object "/name" read-write; its size is the object's size.
  static absl::StatusOr<ShmObject> OpenNamed(absl::string_view name);
  // Opens a path read-write (e.g. /proc/PID/fd/N of a peer's memfd).
  static absl::StatusOr<ShmObject> OpenPath(absl::string_view path);
  // Takes ownership of `fd` (closed on every path).
  static absl::StatusOr<ShmObject> Adopt(int fd, absl::string_view what);

  ShmObject() = default;
  ShmObject(ShmObject&& other) noexcept { *this = std::move(other); }
  ShmObject& operator=(ShmObject&& other) noexcept;
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;
  ~ShmObject() { Reset(); }

  int fd() const { return fd_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }  // "/name", a path, or the memfd's name
  bool valid() const { return fd_ >= 0; }

  // Maps the whole object read-write, shared. The mapping outlives the object if kept.
  absl::StatusOr<ShmMapping> Map() const;
  // Removes the name this process created (no-op otherwise, and the second time).
  absl::Status Unlink();
  void Reset();  // unlinks a name still held, closes the fd

 private:
  ShmObject(int fd, size_t size, std::string name, bool owns_name)
      : fd_(fd), size_(size), name_(std::move(name)), owns_name_(owns_name) {}
  int fd_ = -1;
  size_t size_ = 0;
  std::string name_;
  bool owns_name_ = false;
};

}  // namespace moe

#endif  // MOED_TRANSPORT_SHM_OBJECT_H_
