// MemoryKeyValueStore: a thread-safe, in-process KeyValueStore for tests that run several
// ranks as threads of one process (each thread makes its own communicator from the same store).
//
//   auto store = std::make_shared<MemoryKeyValueStore>();
//   std::thread t([&] { MakeGlooCommunicator(store, "test", 1, 2, {}); });
//   ASSIGN_OR_RETURN(auto comm, MakeGlooCommunicator(store, "test", 0, 2, {}));
#ifndef MOED_ENGINE_COMM_MEMORY_KV_STORE_H_
#define MOED_ENGINE_COMM_MEMORY_KV_STORE_H_

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/comm/kv_store.h"

namespace moe {

class MemoryKeyValueStore : public KeyValueStore {
 public:
  MemoryKeyValueStore() = default;
  MemoryKeyValueStore(const MemoryKeyValueStore&) = delete;
  MemoryKeyValueStore& operator=(const MemoryKeyValueStore&) = delete;

  // Overwrites an existing key (last writer wins) and wakes every waiting Get.
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_ENGINE_COMM_MEMORY_KV_STORE_H_
