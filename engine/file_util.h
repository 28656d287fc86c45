// Small POSIX file helpers shared by checkpoints (engine/checkpoint_file.h) and the file
// key-value store (engine/comm/file_kv_store.h): atomic durable writes, whole-file reads,
// mkdir -p, and errno as an absl::Status.
//
//   RETURN_IF_ERROR(MakeDirectories(dir));
//   RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.txt", {header, body}));
//   ASSIGN_OR_RETURN(std::string text, ReadWholeFile(dir + "/config.txt"));
#ifndef MOED_ENGINE_FILE_UTIL_H_
#define MOED_ENGINE_FILE_UTIL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

// Writes `pieces` (concatenated) to `path` atomically: a temporary file next to it
// (`<path>.tmp.<pid>.<n>`), fsync, rename over `path`, fsync of the directory. On failure
// `path` is untouched and the temporary file is removed. Readers see the old or the new
// contents, never a part.
absl::Status WriteFileAtomically(const std::string& path,
                                 const std::vector<absl::string_view>& pieces);

// Reads a whole file. NOT_FOUND when it does not exist.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

// Creates `dir` (and missing parents); fine when it exists. FAILED_PRECONDITION when it is a
// file.
absl::Status MakeDirectories(const std::string& dir);

// The Status for a failed system call: NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED
// (ENOSPC) or INTERNAL, with `what` and strerror(err).
absl::Status ErrnoStatus(int err, absl::string_view what);

}  // namespace moe

#endif  // MOED_ENGINE_FILE_UTIL_H_
