#include "engine/comm/file_kv_store.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/file_util.h"

namespace moe {
namespace {

// File errors name the store, so that a rendezvous failure is recognisable in a log.
absl::Status InStore(const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("key-value store: ", status.message()));
}

}  // namespace

absl::StatusOr<std::shared_ptr<FileKeyValueStore>> FileKeyValueStore::Create(
    const std::string& dir) {
  absl::Status made = InStore(MakeDirectories(dir));
  if (!made.ok()) return made;
  return std::shared_ptr<FileKeyValueStore>(new FileKeyValueStore(dir));
}

std::string FileKeyValueStore::EscapeKey(const std::string& key) {
  std::string name;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '_' || c == '-') {
      name.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&name, "%%%02X", c);
    }
  }
  return name;
}

absl::Status FileKeyValueStore::Set(const std::string& key, const std::string& value) {
  if (key.empty()) return absl::InvalidArgumentError("key-value store: empty key");
  // Atomic (readers never see part of a value); the temporary name contains '.', which
  // EscapeKey never produces, so it never collides with a key.
  return InStore(WriteFileAtomically(absl::StrCat(dir_, "/", EscapeKey(key)), {value}));
}

absl::StatusOr<std::string> FileKeyValueStore::Get(const std::string& key, absl::Duration timeout) {
  if (key.empty()) return absl::InvalidArgumentError("key-value store: empty key");
  const std::string path = absl::StrCat(dir_, "/", EscapeKey(key));
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration pause = absl::Milliseconds(1);
  while (true) {
    absl::StatusOr<std::string> value = ReadWholeFile(path);
    if (value.ok()) return value;
    if (!absl::IsNotFound(value.status())) return InStore(value.status());
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("key-value store: key '", key,
                                                      "' not set in ", dir_, " within ",
                                                      absl::FormatDuration(timeout)));
    }
    // Back off to 20 ms: rendezvous waits are short, but tests may wait for seconds.
    absl::SleepFor(std::min(pause, deadline - now));
    pause = std::min(pause * 2, absl::Milliseconds(20));
  }
}

}  // namespace moe
