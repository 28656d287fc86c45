// DurableStore: moed's durable layers under --state_dir (issue 14, finding 5). It keeps the
// layer registry (names, configs, the latest durable checkpoint and its optimizer step) and
// the durable checkpoints themselves, so that a moed restart restores every layer and a
// respawned worker reloads its shard instead of resetting to init_seed.
//
// Layout of the store's folder (STATE_DIR/layers, 0700, moed's user):
//   FORMAT          "moed durable layers v1\n"; another text is refused at Open
//   LOCK            flock held by the moed using the store (a second moed is refused)
//   registry        the layers, rewritten atomically (engine/file_util.h: temp file, fsync,
//                   rename, fsync of the folder) and CRC-32C-checked:
//                     moed durable registry v1
//                     next <next incarnation> <next checkpoint sequence>
//                     layer <incarnation> <optimizer step> <saved unix ms> <checkpoint|-> <name>
//                     config <ConfigToString>
//                     ...
//                     crc <crc32c of every byte above, 8 hex digits>
//   L<incarnation>/c<sequence>   a layer's durable checkpoints (engine/checkpoint.h files plus
//                   the MOED_CHECKPOINT marker), written through a CheckpointRoot: staged under
//                   .staging/ and renamed into place. The newest two are kept.
// Nothing in a path comes from a request: a layer's folder is named by its incarnation (a
// number the store hands out), never by its name.
//
// Open refuses, with a message naming the file and the reason, a folder that is not a store
// (files but no FORMAT), another FORMAT, a registry that does not parse or fails its CRC, and
// a referenced checkpoint that is missing or fails verification (every file read and
// CRC-checked: engine/checkpoint.h VerifyCheckpoint). Nothing is changed before all of that
// passed; then leftovers of a crash are removed: temporary files of interrupted atomic
// writes, staging of a dead moed (CheckpointRoot), layer folders the registry no longer
// names (a DeleteLayer cut short) and checkpoints newer than the registry's (a save whose
// registry update never happened).
//
//   ASSIGN_OR_RETURN(std::unique_ptr<DurableStore> store, DurableStore::Open(dir));
//   for (const DurableLayer& layer : store->layers()) ...         // restore them
//   ASSIGN_OR_RETURN(DurableLayer created, store->AddLayer(name, config));
//   ASSIGN_OR_RETURN(CheckpointRoot::Staging staging, store->BeginCheckpoint(created));
//   ... workers SaveCheckpoint into staging.path ...
//   RETURN_IF_ERROR(store->CommitCheckpoint(staging, &created, step));   // or AbortCheckpoint
//   RETURN_IF_ERROR(store->RemoveLayer(created));
//
// Thread-safe: every method takes mu_; a checkpoint's files are written by the workers
// outside it.
#ifndef MOED_SERVER_DURABLE_STORE_H_
#define MOED_SERVER_DURABLE_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/config.h"
#include "server/checkpoint_root.h"

namespace moe {

// One layer's durable record.
struct DurableLayer {
  std::string name;
  LayerConfig config;
  uint64_t incarnation = 0;    // names its folder L<incarnation>; unique within the store
  int64_t optimizer_step = 0;  // ApplyOptimizer calls the durable checkpoint includes
  std::string checkpoint;      // "L<incarnation>/c<sequence>"; empty: init_seed, no save yet
  absl::Time saved_at = absl::InfinitePast();  // of the checkpoint
};

class DurableStore {
 public:
  // Opens (creating it when absent or empty) the store in `dir`; see the file comment for
  // what is refused and what is cleaned. `cleaned` (optional) receives one line per leftover
  // removed.
  static absl::StatusOr<std::unique_ptr<DurableStore>> Open(
      const std::string& dir, std::vector<std::string>* cleaned = nullptr);
  ~DurableStore();
  DurableStore(const DurableStore&) = delete;
  DurableStore& operator=(const DurableStore&) = delete;

  // The layers the registry holds, by name.
  std::vector<DurableLayer> layers() const;

  // Registers a new layer (durable at optimizer step 0: its init_seed state).
  // ALREADY_EXISTS if the registry has the name.
  absl::StatusOr<DurableLayer> AddLayer(const std::string& name, const LayerConfig& config);
  // Takes the layer out of the registry, then removes its folder. NOT_FOUND when the registry
  // has no such incarnation (fine to ignore).
  absl::Status RemoveLayer(const DurableLayer& layer);

  // A staging directory for the workers to save the layer's next durable checkpoint into.
  absl::StatusOr<CheckpointRoot::Staging> BeginCheckpoint(const DurableLayer& layer);
  // Moves the staged checkpoint into place, points the registry at it (optimizer_step, now)
  // and removes the layer's checkpoints but the newest two. On success *layer is the new
  // record. FAILED_PRECONDITION when the layer was removed meanwhile (the staging is dropped).
  absl::Status CommitCheckpoint(const CheckpointRoot::Staging& staging, DurableLayer* layer,
                                int64_t optimizer_step);
  void AbortCheckpoint(const CheckpointRoot::Staging& staging);

  // Absolute path of a record's checkpoint (for the workers' LoadCheckpoint).
  std::string CheckpointPath(const DurableLayer& layer) const;
  const std::string& path() const { return path_; }

 private:
  DurableStore(std::string path, int lock_fd, std::unique_ptr<CheckpointRoot> root);
  absl::Status WriteRegistryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the layer's checkpoints (folders c<sequence>) except `keep` newest ones up to
  // and including its current checkpoint, and every newer one. Best effort.
  void PruneLocked(const DurableLayer& layer, int keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const int lock_fd_;
  const std::unique_ptr<CheckpointRoot> root_;
  mutable absl::Mutex mu_;
  std::map<std::string, DurableLayer> layers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_incarnation_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace moe

#endif  // MOED_SERVER_DURABLE_STORE_H_
