// A small key-value store for rendezvous: ranks publish their addresses (Gloo) or the NCCL
// unique id under a key and wait for the others'. The front end serves one over gRPC; tests
// use the in-process or file-backed ones.
//
//   RETURN_IF_ERROR(store->Set("rank/0", address));
//   ASSIGN_OR_RETURN(std::string peer, store->Get("rank/1", absl::Seconds(10)));
#ifndef MOED_ENGINE_COMM_KV_STORE_H_
#define MOED_ENGINE_COMM_KV_STORE_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until the key exists; DEADLINE_EXCEEDED after `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
};

}  // namespace moe

#endif  // MOED_ENGINE_COMM_KV_STORE_H_
