// CheckpointRoot: the one directory under which moed reads and writes checkpoints.
//
// A request names a checkpoint by a relative path inside the root ("run7/layer0"); nothing
// outside the root can be named, created, replaced or probed:
//   - names are checked component by component (no absolute paths, "..", ".", empty or
//     hidden components, only [A-Za-z0-9_-.] characters, bounded length and depth);
//   - the path is walked with openat(O_NOFOLLOW | O_DIRECTORY) from a descriptor of the
//     root, so a symbolic link anywhere on the way is refused, not followed;
//   - an existing path is replaced only when it is a checkpoint moed wrote (it holds the
//     marker file kCheckpointMarker); anything else is never touched;
//   - saves are staged under <root>/.staging/<instance>/ and renamed into place (atomic
//     exchange where the filesystem supports it); a moed instance holds an flock on its
//     staging folder, so staging left by a killed moed is removed at the next start.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<CheckpointRoot> root, CheckpointRoot::Open("/ckpt"));
//   ASSIGN_OR_RETURN(CheckpointRoot::Staging staging, root->BeginSave("run7/layer0"));
//   ... workers write into staging.path ...
//   RETURN_IF_ERROR(root->CommitSave(staging));   // or root->AbortSave(staging)
//   ASSIGN_OR_RETURN(std::string dir, root->ResolveForLoad("run7/layer0"));
//
// The root is created 0700 and must belong to moed's user: the walk is safe against
// requests, and a local user who cannot write into the root cannot race it (docs/SECURITY.md).
// Workers get absolute paths inside the root, so external workers mount the same volume at
// the same path.
#ifndef MOED_SERVER_CHECKPOINT_ROOT_H_
#define MOED_SERVER_CHECKPOINT_ROOT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

// File moed writes into every checkpoint directory it commits.
inline constexpr char kCheckpointMarker[] = "MOED_CHECKPOINT";

class CheckpointRoot {
 public:
  // A save in progress: the workers write into `path` (absolute, inside the root).
  struct Staging {
    std::string name;  // the request's checkpoint name, normalised
    std::string id;    // entry under this instance's staging folder
    std::string path;  // absolute path of the staging directory
    // The layer's optimizer_step (LayerInfo) as saved: written into the marker by CommitSave,
    // read back by SavedOptimizerStep. -1: none recorded.
    int64_t optimizer_step = -1;
  };

  // Creates `path` (and missing parents, 0700) if needed, checks that it is a directory
  // owned by this user, tightens it to 0700, removes staging left by moed instances that
  // are gone, and takes this instance's staging folder. Errors name the path.
  static absl::StatusOr<std::unique_ptr<CheckpointRoot>> Open(const std::string& path);
  ~CheckpointRoot();

  CheckpointRoot(const CheckpointRoot&) = delete;
  CheckpointRoot& operator=(const CheckpointRoot&) = delete;

  // INVALID_ARGUMENT unless `name` is a valid checkpoint name (see the file comment);
  // `field` prefixes the message (a trailing '/' is an empty last component: refused).
  // Returns the name.
  static absl::StatusOr<std::string> CheckName(absl::string_view field, absl::string_view name);

  // Checks the name, creates missing parent folders inside the root (refusing symbolic
  // links: INVALID_ARGUMENT), refuses an existing target that is not a moed checkpoint
  // (FAILED_PRECONDITION, untouched), and creates an empty staging directory.
  absl::StatusOr<Staging> BeginSave(absl::string_view name);
  // Writes the marker into the staging directory and moves it into place; a checkpoint
  // that was there is removed once replaced. The staging is gone on success and on error.
  absl::Status CommitSave(const Staging& staging);
  // Removes the staging directory (a save that failed on a worker).
  void AbortSave(const Staging& staging);

  // The absolute path of the checkpoint `name`: NOT_FOUND when nothing is there,
  // FAILED_PRECONDITION when what is there is not a moed checkpoint, INVALID_ARGUMENT for
  // a bad name or a symbolic link on the way.
  absl::StatusOr<std::string> ResolveForLoad(absl::string_view name) const;
  // The optimizer_step recorded in the marker of checkpoint `name` (Staging::optimizer_step),
  // -1 when it records none (a checkpoint of an older moed); ResolveForLoad's errors.
  absl::StatusOr<int64_t> SavedOptimizerStep(absl::string_view name) const;

  const std::string& path() const { return path_; }

 private:
  CheckpointRoot(std::string path, int root_fd, int staging_fd, std::string instance);

  // Walks the parent folders of `name` from the root; with `create`, makes missing ones.
  // Returns an owned descriptor of the parent folder and sets *last to the final component.
  absl::StatusOr<int> OpenParent(const std::string& name, bool create, std::string* last) const;

  const std::string path_;  // realpath of the root
  const int root_fd_;       // O_DIRECTORY descriptor of the root
  const int staging_fd_;    // this instance's folder under .staging (flock held)
  const std::string instance_;
  std::atomic<uint64_t> next_id_{0};
};

}  // namespace moe

#endif  // MOED_SERVER_CHECKPOINT_ROOT_H_
