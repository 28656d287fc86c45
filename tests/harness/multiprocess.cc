#include "tests/harness/multiprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

extern char** environ;

namespace moe {
namespace harness {
namespace {

constexpr char kWorkerEnv[] = "MOED_HARNESS_WORKER";
constexpr char kRankEnv[] = "MOED_HARNESS_RANK";
constexpr char kSizeEnv[] = "MOED_HARNESS_SIZE";
constexpr char kStoreEnv[] = "MOED_HARNESS_STORE_DIR";
constexpr char kWorkEnv[] = "MOED_HARNESS_WORK_DIR";
constexpr char kResultEnv[] = "MOED_HARNESS_RESULT_DIR";
constexpr char kParamPrefix[] = "MOED_HARNESS_P_";

std::map<std::string, WorkerFunction>& Registry() {
  static auto* registry = new std::map<std::string, WorkerFunction>();
  return *registry;
}

absl::Status ErrnoError(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::Status MakeDir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return ErrnoError("mkdir " + dir);
  return absl::OkStatus();
}

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string FreshWorkDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  static int launches = 0;
  return absl::StrCat(base != nullptr ? base : "/tmp", "/harness_", getpid(), "_", launches++, "_",
                      absl::ToUnixMicros(absl::Now()));
}

bool ValidParamKey(const std::string& key) {
  if (key.empty()) return false;
  for (char c : key) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  }
  return true;
}

}  // namespace

std::string WorkerContext::Param(const std::string& key, const std::string& fallback) const {
  auto it = params.find(key);
  return it == params.end() ? fallback : it->second;
}

int64_t WorkerContext::IntParam(const std::string& key, int64_t fallback) const {
  int64_t value;
  auto it = params.find(key);
  if (it == params.end() || !absl::SimpleAtoi(it->second, &value)) return fallback;
  return value;
}

bool RegisterWorker(const std::string& name, WorkerFunction fn) {
  Registry()[name] = std::move(fn);
  return true;
}

bool LaunchResult::AllSucceeded() const {
  for (const RankResult& rank : ranks) {
    if (!rank.ok()) return false;
  }
  return !ranks.empty();
}

std::string LaunchResult::Summary() const {
  std::string summary;
  for (const RankResult& r : ranks) {
    std::string state;
    if (r.killed_at_deadline) {
      state = "killed at the deadline";
    } else if (r.signal != 0) {
      state = absl::StrCat("killed by signal ", r.signal, " (", strsignal(r.signal), ")");
    } else {
      state = absl::StrCat("exit ", r.exit_code);
    }
    constexpr size_t kTail = 2000;
    const std::string tail = r.stderr_text.size() > kTail
                                 ? "..." + r.stderr_text.substr(r.stderr_text.size() - kTail)
                                 : r.stderr_text;
    absl::StrAppend(&summary, "rank ", r.rank, ": ", state, " after ",
                    absl::FormatDuration(r.elapsed), "\n", tail, tail.empty() ? "" : "\n");
  }
  return summary;
}

absl::StatusOr<LaunchResult> RunWorkers(const LaunchOptions& options) {
  if (options.worker.empty()) return absl::InvalidArgumentError("RunWorkers: no worker name");
  if (options.size < 1) return absl::InvalidArgumentError("RunWorkers: size must be >= 1");
  for (const auto& [key, value] : options.params) {
    if (!ValidParamKey(key)) return absl::InvalidArgumentError("RunWorkers: bad key " + key);
  }
  LaunchResult result;
  result.work_dir = options.work_dir.empty() ? FreshWorkDir() : options.work_dir;
  result.store_dir = result.work_dir + "/store";
  if (absl::Status s = MakeDir(result.work_dir); !s.ok()) return s;
  if (absl::Status s = MakeDir(result.store_dir); !s.ok()) return s;
  const std::string binary = options.binary.empty() ? "/proc/self/exe" : options.binary;

  // Everything a child needs is built before fork(): after fork in a threaded parent only
  // async-signal-safe calls are allowed (open, dup2, prctl, execve).
  struct Child {
    std::vector<std::string> env;
    std::string log_path;
    pid_t pid = -1;
  };
  std::vector<Child> children(options.size);
  result.ranks.resize(options.size);
  for (int rank = 0; rank < options.size; ++rank) {
    RankResult& r = result.ranks[rank];
    r.rank = rank;
    r.result_dir = absl::StrCat(result.work_dir, "/rank_", rank);
    if (absl::Status s = MakeDir(r.result_dir); !s.ok()) return s;
    Child& child = children[rank];
    child.log_path = r.result_dir + "/stderr.txt";
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "MOED_HARNESS_", 13) != 0) child.env.emplace_back(*e);
    }
    child.env.push_back(absl::StrCat(kWorkerEnv, "=", options.worker));
    child.env.push_back(absl::StrCat(kRankEnv, "=", rank));
    child.env.push_back(absl::StrCat(kSizeEnv, "=", options.size));
    child.env.push_back(absl::StrCat(kStoreEnv, "=", result.store_dir));
    child.env.push_back(absl::StrCat(kWorkEnv, "=", result.work_dir));
    child.env.push_back(absl::StrCat(kResultEnv, "=", r.result_dir));
    std::map<std::string, std::string> params = options.params;
    if (auto it = options.rank_params.find(rank); it != options.rank_params.end()) {
      for (const auto& [key, value] : it->second) {
        if (!ValidParamKey(key)) return absl::InvalidArgumentError("RunWorkers: bad key " + key);
        params[key] = value;
      }
    }
    for (const auto& [key, value] : params) {
      child.env.push_back(absl::StrCat(kParamPrefix, key, "=", value));
    }
  }

  const absl::Time start = absl::Now();
  const pid_t parent = getpid();
  for (int rank = 0; rank < options.size; ++rank) {
    Child& child = children[rank];
    std::vector<char*> envp;
    for (std::string& e : child.env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string arg0 = binary;
    char* argv[] = {arg0.data(), nullptr};
    const pid_t pid = fork();
    if (pid < 0) {
      const absl::Status error = ErrnoError("fork");
      for (int r = 0; r < rank; ++r) kill(children[r].pid, SIGKILL);
      for (int r = 0; r < rank; ++r) waitpid(children[r].pid, nullptr, 0);
      return error;
    }
    if (pid == 0) {
      // A worker must not outlive the test that started it.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(125);
      const int fd = open(child.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        close(fd);
      }
      execve(binary.c_str(), argv, envp.data());
      _exit(127);
    }
    child.pid = pid;
  }

  // Reap until every rank has exited or the deadline passes, then kill the rest.
  const absl::Time deadline = start + options.deadline;
  int running = options.size;
  while (running > 0) {
    bool killing = absl::Now() >= deadline;
    for (int rank = 0; rank < options.size; ++rank) {
      Child& child = children[rank];
      if (child.pid < 0) continue;
      RankResult& r = result.ranks[rank];
      if (killing) {
        kill(child.pid, SIGKILL);
        r.killed_at_deadline = true;
      }
      int status = 0;
      const pid_t done = waitpid(child.pid, &status, killing ? 0 : WNOHANG);
      if (done == child.pid) {
        r.elapsed = absl::Now() - start;
        if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
        child.pid = -1;
        --running;
      }
    }
    if (running > 0) absl::SleepFor(absl::Milliseconds(5));
  }
  for (RankResult& r : result.ranks) {
    r.stderr_text = ReadWholeFile(children[r.rank].log_path);
  }
  return result;
}

absl::Status WriteResult(const WorkerContext& ctx, const std::string& name,
                         const std::string& bytes) {
  const std::string path = ctx.result_dir + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::InternalError("cannot write result file " + path);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadResult(const RankResult& rank, const std::string& name) {
  const std::string path = rank.result_dir + "/" + name;
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("rank ", rank.rank, " wrote no ", name));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int MaybeRunAsWorker() {
  const char* worker = std::getenv(kWorkerEnv);
  if (worker == nullptr) return -1;
  WorkerContext ctx;
  ctx.worker = worker;
  const char* rank = std::getenv(kRankEnv);
  const char* size = std::getenv(kSizeEnv);
  if (rank == nullptr || size == nullptr || !absl::SimpleAtoi(rank, &ctx.rank) ||
      !absl::SimpleAtoi(size, &ctx.size)) {
    std::fprintf(stderr, "harness worker: bad %s/%s\n", kRankEnv, kSizeEnv);
    return 2;
  }
  if (const char* dir = std::getenv(kStoreEnv)) ctx.store_dir = dir;
  if (const char* dir = std::getenv(kWorkEnv)) ctx.work_dir = dir;
  if (const char* dir = std::getenv(kResultEnv)) ctx.result_dir = dir;
  const size_t prefix_length = std::strlen(kParamPrefix);
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, kParamPrefix, prefix_length) != 0) continue;
    const char* entry = *e + prefix_length;
    const char* equals = std::strchr(entry, '=');
    if (equals == nullptr) continue;
    ctx.params[std::string(entry, equals)] = std::string(equals + 1);
  }
  auto it = Registry().find(ctx.worker);
  if (it == Registry().end()) {
    std::fprintf(stderr, "harness worker: no worker named '%s' in this binary\n", worker);
    return 2;
  }
  const absl::Status status = it->second(ctx);
  if (!status.ok()) {
    std::fprintf(stderr, "rank %d worker %s failed: %s\n", ctx.rank, worker,
                 status.ToString().c_str());
    WriteResult(ctx, "status.txt", status.ToString()).IgnoreError();
    return 1;
  }
  WriteResult(ctx, "status.txt", "OK").IgnoreError();
  return 0;
}

}  // namespace harness
}  // namespace moe
