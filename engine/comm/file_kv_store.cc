#include "engine/comm/file_kv_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moe {
namespace {

// The check for the errno domain: a failed system call as a Status naming the call and path.
absl::Status ErrnoStatus(const char* call, const std::string& path, int err) {
  const std::string message =
      absl::StrCat("key-value store: ", call, "(", path, "): ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status MakeDirectories(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("key-value store: empty directory");
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus("mkdir", prefix, errno);
    }
  }
  struct stat info;
  if (stat(dir.c_str(), &info) != 0) return ErrnoStatus("stat", dir, errno);
  if (!S_ISDIR(info.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("key-value store: ", dir, " exists and is not a directory"));
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("write", path, errno);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Reads the whole file; NOT_FOUND if it does not exist (yet).
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("open", path, errno);
  std::string data;
  char chunk[4096];
  while (true) {
    const ssize_t n = read(fd, chunk, sizeof(chunk));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      close(fd);
      return ErrnoStatus("read", path, err);
    }
    if (n == 0) break;
    data.append(chunk, static_cast<size_t>(n));
  }
  close(fd);
  return data;
}

}  // namespace

absl::StatusOr<std::shared_ptr<FileKeyValueStore>> FileKeyValueStore::Create(
    const std::string& dir) {
  absl::Status made = MakeDirectories(dir);
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
  static std::atomic<uint64_t> counter{0};
  const std::string path = absl::StrCat(dir_, "/", EscapeKey(key));
  // Temporary names start with '.', which EscapeKey never produces, so they never collide
  // with a key; pid + counter keep concurrent writers (processes and threads) apart.
  const std::string temp = absl::StrCat(dir_, "/.tmp.", getpid(), ".", counter++);
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("open", temp, errno);
  absl::Status written = WriteAll(fd, value, temp);
  if (close(fd) != 0 && written.ok()) written = ErrnoStatus("close", temp, errno);
  if (written.ok() && rename(temp.c_str(), path.c_str()) != 0) {
    written = ErrnoStatus("rename", path, errno);
  }
  if (!written.ok()) unlink(temp.c_str());
  return written;
}

absl::StatusOr<std::string> FileKeyValueStore::Get(const std::string& key, absl::Duration timeout) {
  if (key.empty()) return absl::InvalidArgumentError("key-value store: empty key");
  const std::string path = absl::StrCat(dir_, "/", EscapeKey(key));
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration pause = absl::Milliseconds(1);
  while (true) {
    absl::StatusOr<std::string> value = ReadFile(path);
    if (!absl::IsNotFound(value.status())) return value;
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
