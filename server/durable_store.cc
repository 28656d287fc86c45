#include "server/durable_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "engine/checkpoint.h"
#include "engine/checkpoint_file.h"  // Crc32c
#include "engine/file_util.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

constexpr char kFormatFile[] = "FORMAT";
constexpr char kFormatText[] = "moed durable layers v1\n";
constexpr char kLockFile[] = "LOCK";
constexpr char kRegistryFile[] = "registry";
constexpr char kRegistryHeader[] = "moed durable registry v1";
constexpr char kStagingFolder[] = ".staging";  // CheckpointRoot's
constexpr int kCheckpointsKept = 2;

std::string LayerFolder(uint64_t incarnation) { return absl::StrCat("L", incarnation); }
std::string CheckpointName(uint64_t incarnation, uint64_t sequence) {
  return absl::StrFormat("L%d/c%020d", incarnation, sequence);
}
// The sequence of "c<digits>" (0 if `entry` is not one).
uint64_t SequenceOf(absl::string_view entry) {
  uint64_t sequence = 0;
  if (entry.size() < 2 || entry[0] != 'c' || !absl::SimpleAtoi(entry.substr(1), &sequence)) {
    return 0;
  }
  return sequence;
}
// The sequence of a record's checkpoint ("L<inc>/c<seq>"), 0 when it has none.
uint64_t SequenceOf(const DurableLayer& layer) {
  if (layer.checkpoint.empty()) return 0;
  return SequenceOf(layer.checkpoint.substr(layer.checkpoint.find('/') + 1));
}

// A temporary file of WriteFileAtomically ("<file>.tmp.<pid>.<n>").
bool IsTemporary(const std::string& entry) { return absl::StrContains(entry, ".tmp."); }

absl::Status Damaged(const std::string& what, absl::string_view why) {
  return absl::DataLossError(absl::StrCat(what, ": ", why,
                                          "; moed refuses to start on a damaged state "
                                          "directory (restore it from a backup, or move it "
                                          "away to start without these layers)"));
}

struct Registry {
  std::vector<DurableLayer> layers;
  uint64_t next_incarnation = 1;
  uint64_t next_sequence = 1;
};

std::string FormatRegistry(const Registry& registry) {
  std::string text = absl::StrCat(kRegistryHeader, "\nnext ", registry.next_incarnation, " ",
                                  registry.next_sequence, "\n");
  for (const DurableLayer& layer : registry.layers) {
    const int64_t saved_ms = layer.checkpoint.empty() ? 0 : absl::ToUnixMillis(layer.saved_at);
    absl::StrAppend(&text, "layer ", layer.incarnation, " ", layer.optimizer_step, " ", saved_ms,
                    " ", layer.checkpoint.empty() ? "-" : layer.checkpoint, " ", layer.name,
                    "\nconfig ", ConfigToString(layer.config), "\n");
  }
  absl::StrAppend(&text, "crc ", absl::Hex(Crc32c(text), absl::kZeroPad8), "\n");
  return text;
}

absl::StatusOr<Registry> ParseRegistry(const std::string& path, const std::string& text) {
  const size_t crc_at = text.rfind("crc ");
  uint32_t crc = 0;
  if (crc_at == std::string::npos || !absl::EndsWith(text, "\n") ||
      !absl::SimpleHexAtoi(absl::string_view(text).substr(crc_at + 4, text.size() - crc_at - 5),
                           &crc) ||
      crc != Crc32c(absl::string_view(text).substr(0, crc_at))) {
    return Damaged(path, "truncated or its checksum does not match");
  }
  std::vector<std::string> lines =
      absl::StrSplit(absl::string_view(text).substr(0, crc_at), '\n', absl::SkipEmpty());
  if (lines.empty() || lines[0] != kRegistryHeader) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": written by another version of moed (first line \"",
                     lines.empty() ? "" : lines[0], "\", expected \"", kRegistryHeader, "\")"));
  }
  Registry registry;
  auto bad = [&](size_t i) {
    return Damaged(path, absl::StrCat("line ", i + 1, " does not parse"));
  };
  if (lines.size() < 2) return bad(1);
  std::vector<std::string> next = absl::StrSplit(lines[1], ' ');
  if (next.size() != 3 || next[0] != "next" ||
      !absl::SimpleAtoi(next[1], &registry.next_incarnation) ||
      !absl::SimpleAtoi(next[2], &registry.next_sequence)) {
    return bad(1);
  }
  for (size_t i = 2; i < lines.size(); i += 2) {
    std::vector<std::string> f = absl::StrSplit(lines[i], ' ');
    DurableLayer layer;
    int64_t saved_ms = 0;
    if (f.size() != 6 || f[0] != "layer" || !absl::SimpleAtoi(f[1], &layer.incarnation) ||
        !absl::SimpleAtoi(f[2], &layer.optimizer_step) || !absl::SimpleAtoi(f[3], &saved_ms) ||
        layer.incarnation == 0 || layer.incarnation >= registry.next_incarnation) {
      return bad(i);
    }
    layer.name = f[5];
    if (f[4] != "-") {
      layer.checkpoint = f[4];
      const uint64_t sequence = SequenceOf(layer);
      if (!absl::StartsWith(layer.checkpoint, LayerFolder(layer.incarnation) + "/") ||
          sequence == 0 || sequence >= registry.next_sequence ||
          layer.checkpoint != CheckpointName(layer.incarnation, sequence)) {
        return bad(i);
      }
      layer.saved_at = absl::FromUnixMillis(saved_ms);
    }
    if (i + 1 >= lines.size() || !absl::StartsWith(lines[i + 1], "config ")) return bad(i + 1);
    absl::StatusOr<LayerConfig> config = ConfigFromString(lines[i + 1].substr(7));
    if (!config.ok()) return Damaged(path, config.status().message());
    layer.config = *config;
    registry.layers.push_back(std::move(layer));
  }
  return registry;
}

// Entries of a folder (names), empty when it cannot be listed.
std::vector<std::string> List(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    names.push_back(entry.path().filename().string());
  }
  return names;
}

void Remove(const std::string& path, std::vector<std::string>* cleaned) {
  std::error_code error;
  if (fs::remove_all(path, error) > 0 && cleaned != nullptr) cleaned->push_back(path);
}

// A committed checkpoint: a real folder holding the marker, whose files all verify.
absl::Status CheckCheckpoint(const std::string& dir, const DurableLayer& layer) {
  const std::string path = absl::StrCat(dir, "/", layer.checkpoint);
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Damaged(path,
                   absl::StrCat("the durable checkpoint of layer \"", layer.name, "\" is missing"));
  }
  const std::string marker = absl::StrCat(path, "/", kCheckpointMarker);
  if (::lstat(marker.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return Damaged(path, "not a checkpoint moed committed (no marker)");
  }
  absl::Status verified = VerifyCheckpoint(layer.config, path);
  if (!verified.ok()) return Damaged(path, verified.message());
  return absl::OkStatus();
}

// Open's steps, each on `dir`.
// 1. The lock: one moed per store. Returns the descriptor that holds it.
absl::StatusOr<int> LockStore(const std::string& dir) {
  const int lock_fd = ::open(absl::StrCat(dir, "/", kLockFile).c_str(),
                             O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock_fd < 0) return ErrnoStatus(errno, absl::StrCat("open ", dir, "/", kLockFile));
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(lock_fd);
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " is in use by another moed (it holds ", kLockFile, ")"));
  }
  return lock_fd;
}

// 2. FORMAT: written into a new (empty) store; anything else must carry ours.
absl::Status CheckFormat(const std::string& dir) {
  const std::string format_path = absl::StrCat(dir, "/", kFormatFile);
  absl::StatusOr<std::string> format = ReadWholeFile(format_path);
  if (absl::IsNotFound(format.status())) {
    for (const std::string& entry : List(dir)) {
      if (entry != kLockFile && entry != kStagingFolder && !IsTemporary(entry)) {
        return absl::FailedPreconditionError(
            absl::StrCat(dir, " holds \"", entry, "\" but no ", kFormatFile,
                         ": not a moed state directory (give --state_dir an empty or new folder)"));
      }
    }
    RETURN_IF_ERROR(WriteFileAtomically(format_path, {kFormatText}));
    format = std::string(kFormatText);
  }
  if (!format.ok()) return format.status();
  if (*format != kFormatText) {
    return absl::FailedPreconditionError(
        absl::StrCat(format_path, " says \"", absl::StripTrailingAsciiWhitespace(*format),
                     "\": written by another version of moed (this one reads \"",
                     absl::StripTrailingAsciiWhitespace(kFormatText), "\")"));
  }
  return absl::OkStatus();
}

// 3. The registry (empty when there is none and no layer folder either), then every
// checkpoint it names: all verified before anything changes.
absl::StatusOr<Registry> ReadVerifiedRegistry(const std::string& dir) {
  const std::string registry_path = absl::StrCat(dir, "/", kRegistryFile);
  Registry registry;
  absl::StatusOr<std::string> text = ReadWholeFile(registry_path);
  if (text.ok()) {
    ASSIGN_OR_RETURN(registry, ParseRegistry(registry_path, *text));
  } else if (!absl::IsNotFound(text.status())) {
    return text.status();
  } else {
    for (const std::string& entry : List(dir)) {
      if (entry[0] == 'L' && entry != kLockFile) {
        return Damaged(registry_path,
                       absl::StrCat("missing, but layer folder ", entry, " is there"));
      }
    }
  }
  for (const DurableLayer& layer : registry.layers) {
    if (layer.checkpoint.empty()) continue;
    RETURN_IF_ERROR(CheckCheckpoint(dir, layer));
  }
  return registry;
}

// 4. Leftovers: temporary files, layer folders the registry does not name (a DeleteLayer cut
// short), and in each layer's folder what is not a checkpoint up to its current one.
void CleanLeftovers(const std::string& dir,
                    const std::map<std::string, const DurableLayer*>& by_folder,
                    std::vector<std::string>* cleaned) {
  for (const std::string& entry : List(dir)) {
    const std::string path = absl::StrCat(dir, "/", entry);
    if (IsTemporary(entry)) {
      Remove(path, cleaned);
    } else if (entry[0] == 'L' && entry != kLockFile && by_folder.count(entry) == 0) {
      Remove(path, cleaned);  // a DeleteLayer cut short
    }
  }
  for (const auto& [folder, layer] : by_folder) {
    const uint64_t current = SequenceOf(*layer);
    for (const std::string& entry : List(absl::StrCat(dir, "/", folder))) {
      // A save committed after the registry's last update, or not a checkpoint at all.
      const uint64_t sequence = SequenceOf(entry);
      if (sequence == 0 || sequence > current) {
        Remove(absl::StrCat(dir, "/", folder, "/", entry), cleaned);
      }
    }
  }
}

}  // namespace

DurableStore::DurableStore(std::string path, int lock_fd, std::unique_ptr<CheckpointRoot> root)
    : path_(std::move(path)), lock_fd_(lock_fd), root_(std::move(root)) {}

DurableStore::~DurableStore() { ::close(lock_fd_); }

absl::StatusOr<std::unique_ptr<DurableStore>> DurableStore::Open(
    const std::string& dir, std::vector<std::string>* cleaned) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("\"", dir, "\" is not an absolute path"));
  }
  RETURN_IF_ERROR(MakeDirectories(dir));
  ::chmod(dir.c_str(), 0700);
  ASSIGN_OR_RETURN(const int lock_fd, LockStore(dir));  // 1.
  auto fail = [&](absl::Status status) {
    ::close(lock_fd);
    return status;
  };
  absl::Status format = CheckFormat(dir);  // 2.
  if (!format.ok()) return fail(format);
  absl::StatusOr<Registry> registry = ReadVerifiedRegistry(dir);  // 3.
  if (!registry.ok()) return fail(registry.status());
  // 4. Verified: take the staging root (removes a dead moed's staging) and clean leftovers.
  absl::StatusOr<std::unique_ptr<CheckpointRoot>> root = CheckpointRoot::Open(dir);
  if (!root.ok()) return fail(root.status());
  std::string resolved = (*root)->path();  // before the root is moved into the store
  auto store = absl::WrapUnique(new DurableStore(std::move(resolved), lock_fd, std::move(*root)));
  absl::MutexLock lock(&store->mu_);
  store->next_incarnation_ = registry->next_incarnation;
  store->next_sequence_ = registry->next_sequence;
  std::map<std::string, const DurableLayer*> by_folder;
  for (const DurableLayer& layer : registry->layers) {
    store->layers_[layer.name] = layer;
    by_folder[LayerFolder(layer.incarnation)] = &layer;
  }
  CleanLeftovers(dir, by_folder, cleaned);
  return store;
}

std::vector<DurableLayer> DurableStore::layers() const {
  absl::MutexLock lock(&mu_);
  std::vector<DurableLayer> out;
  for (const auto& kv : layers_) out.push_back(kv.second);
  return out;
}

absl::Status DurableStore::WriteRegistryLocked() {
  Registry registry;
  registry.next_incarnation = next_incarnation_;
  registry.next_sequence = next_sequence_;
  for (const auto& kv : layers_) registry.layers.push_back(kv.second);
  const std::string text = FormatRegistry(registry);
  return WriteFileAtomically(absl::StrCat(path_, "/", kRegistryFile), {text});
}

absl::StatusOr<DurableLayer> DurableStore::AddLayer(const std::string& name,
                                                    const LayerConfig& config) {
  absl::MutexLock lock(&mu_);
  if (layers_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("durable layer \"", name, "\" exists"));
  }
  DurableLayer layer;
  layer.name = name;
  layer.config = config;
  layer.incarnation = next_incarnation_++;
  layers_[name] = layer;
  absl::Status written = WriteRegistryLocked();
  if (!written.ok()) {
    layers_.erase(name);
    return written;
  }
  return layer;
}

absl::Status DurableStore::RemoveLayer(const DurableLayer& layer) {
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(layer.name);
  if (it == layers_.end() || it->second.incarnation != layer.incarnation) {
    return absl::NotFoundError(absl::StrCat("durable layer \"", layer.name, "\" not registered"));
  }
  const DurableLayer removed = it->second;
  layers_.erase(it);
  absl::Status written = WriteRegistryLocked();
  if (!written.ok()) {
    layers_[removed.name] = removed;
    return written;
  }
  // Not named by the registry any more: a crash before this ends is cleaned at the next Open.
  Remove(absl::StrCat(path_, "/", LayerFolder(removed.incarnation)), nullptr);
  return absl::OkStatus();
}

absl::StatusOr<CheckpointRoot::Staging> DurableStore::BeginCheckpoint(const DurableLayer& layer) {
  uint64_t sequence;
  {
    absl::MutexLock lock(&mu_);
    sequence = next_sequence_++;
  }
  return root_->BeginSave(CheckpointName(layer.incarnation, sequence));
}

void DurableStore::AbortCheckpoint(const CheckpointRoot::Staging& staging) {
  root_->AbortSave(staging);
}

absl::Status DurableStore::CommitCheckpoint(const CheckpointRoot::Staging& staging,
                                            DurableLayer* layer, int64_t optimizer_step) {
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(layer->name);
  if (it == layers_.end() || it->second.incarnation != layer->incarnation) {
    root_->AbortSave(staging);
    return absl::FailedPreconditionError(
        absl::StrCat("layer \"", layer->name, "\" was deleted during its durable checkpoint"));
  }
  RETURN_IF_ERROR(root_->CommitSave(staging));
  const DurableLayer before = it->second;
  it->second.checkpoint = staging.name;
  it->second.optimizer_step = optimizer_step;
  it->second.saved_at = absl::Now();
  absl::Status written = WriteRegistryLocked();
  if (!written.ok()) {
    it->second = before;  // the committed folder is newer than the registry: pruned below
    PruneLocked(before, kCheckpointsKept);
    return written;
  }
  *layer = it->second;
  PruneLocked(*layer, kCheckpointsKept);
  return absl::OkStatus();
}

void DurableStore::PruneLocked(const DurableLayer& layer, int keep) {
  const std::string folder = absl::StrCat(path_, "/", LayerFolder(layer.incarnation));
  const uint64_t current = SequenceOf(layer);
  std::vector<uint64_t> older;
  for (const std::string& entry : List(folder)) {
    const uint64_t sequence = SequenceOf(entry);
    if (sequence == 0) continue;
    if (sequence > current) {
      Remove(absl::StrCat(folder, "/", entry), nullptr);
    } else {
      older.push_back(sequence);
    }
  }
  std::sort(older.rbegin(), older.rend());
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < older.size(); ++i) {
    Remove(absl::StrCat(path_, "/", CheckpointName(layer.incarnation, older[i])), nullptr);
  }
}

std::string DurableStore::CheckpointPath(const DurableLayer& layer) const {
  return absl::StrCat(path_, "/", layer.checkpoint);
}

}  // namespace moe
