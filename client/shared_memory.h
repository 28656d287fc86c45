// A POSIX shared-memory object created and mapped by this process, for moed's zero-copy path
// (RegisterSystemSharedMemory, proto/moe.proto "Shared memory"): put x / d_out in it, let the
// workers write out / d_x into it.
//
//   ASSIGN_OR_RETURN(auto shm, SharedMemoryRegion::Create("/moe-" + std::to_string(getpid()),
//                                                         2 * tokens * hidden * 4));
//   std::memcpy(shm->data(), x.raw(), x.num_bytes());
//   RETURN_IF_ERROR(client->RegisterSystemSharedMemory("io", shm->key(), 0, shm->size()));
//   ASSIGN_OR_RETURN(auto fwd, client->ForwardShm("l0", {"io", 0, DType::kFloat32,
//                                                 {tokens, hidden}}, {"io", x.num_bytes()}));
//   ... out is at shm->data() + x.num_bytes() ...
//
// The object is unlinked and unmapped when the SharedMemoryRegion is destroyed; moed then
// drops a registration of it by itself (it notices the unlinked object).
#ifndef MOED_CLIENT_SHARED_MEMORY_H_
#define MOED_CLIENT_SHARED_MEMORY_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace moe {
namespace client {

class SharedMemoryRegion {
 public:
  // Creates `key` ("/name", exclusive: ALREADY_EXISTS if it exists) with mode 0600, sized
  // byte_size (zero-filled), and maps it read-write.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(const std::string& key,
                                                                    size_t byte_size);
  ~SharedMemoryRegion();  // unmaps and unlinks
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& key() const { return key_; }
  char* data() { return static_cast<char*>(base_); }
  size_t size() const { return size_; }

 private:
  SharedMemoryRegion(std::string key, void* base, size_t size)
      : key_(std::move(key)), base_(base), size_(size) {}
  const std::string key_;
  void* const base_;
  const size_t size_;
};

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_SHARED_MEMORY_H_
