// FileKeyValueStore: a KeyValueStore kept in a directory, one file per key, for tests whose
// ranks are separate processes on one host (or hosts sharing a file system).
//
// A key is stored in the file <dir>/<escaped key>; Set writes a temporary file in the same
// directory and renames it over the key's file, so a reader sees either no file or the whole
// value, never a partial write. Get polls for the file until it appears or the timeout passes.
//
//   ASSIGN_OR_RETURN(std::shared_ptr<FileKeyValueStore> store,
//                    FileKeyValueStore::Create("/tmp/rendezvous"));
//   RETURN_IF_ERROR(store->Set("rank/0", address));
#ifndef MOED_ENGINE_COMM_FILE_KV_STORE_H_
#define MOED_ENGINE_COMM_FILE_KV_STORE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/comm/kv_store.h"

namespace moe {

class FileKeyValueStore : public KeyValueStore {
 public:
  // Creates `dir` (and its parents) if it does not exist.
  static absl::StatusOr<std::shared_ptr<FileKeyValueStore>> Create(const std::string& dir);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

  const std::string& dir() const { return dir_; }

  // The file name of a key: [A-Za-z0-9_-] stay, every other byte becomes %XX (so "/" cannot
  // leave the directory and "." cannot name it).
  static std::string EscapeKey(const std::string& key);

 private:
  explicit FileKeyValueStore(std::string dir) : dir_(std::move(dir)) {}

  const std::string dir_;
};

}  // namespace moe

#endif  // MOED_ENGINE_COMM_FILE_KV_STORE_H_
