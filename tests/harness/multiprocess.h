// A multi-process test harness: runs R worker processes of a test binary on localhost, waits
// for them with a deadline, kills stragglers, and reports each rank's exit status, stderr and
// result files. Every expert-parallel and Gloo test uses it.
//
// A test binary links :worker_main (instead of gtest's main) and registers worker functions.
// Run normally, the binary runs its gtest tests; a test calls RunWorkers(), which re-executes
// the same binary (/proc/self/exe) R times with MOED_HARNESS_* environment variables naming
// the worker function, the rank, the size, a shared file-store directory and a per-rank result
// directory. The worker's Status becomes its exit code (0 ok, 1 error; message on stderr).
//
//   MOED_WORKER(add_ranks, const WorkerContext& ctx) {
//     ...use ctx.rank, ctx.size, ctx.store_dir...
//     return WriteResult(ctx, "sum", EncodeValues(std::vector<float>{...}));
//   }
//   TEST(Ep, Works) {
//     LaunchOptions launch;
//     launch.worker = "add_ranks";
//     launch.size = 2;
//     ASSERT_OK_AND_ASSIGN(LaunchResult run, RunWorkers(launch));
//     ASSERT_TRUE(run.AllSucceeded()) << run.Summary();
//     ... ReadResult(run.ranks[0], "sum") ...
//   }
#ifndef MOED_TESTS_HARNESS_MULTIPROCESS_H_
#define MOED_TESTS_HARNESS_MULTIPROCESS_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe {
namespace harness {

// What a worker process knows about itself (read from its environment).
struct WorkerContext {
  std::string worker;  // the registered function being run
  int rank = 0;
  int size = 1;
  std::string store_dir;   // shared by all ranks: a FileKeyValueStore directory
  std::string work_dir;    // shared by all ranks: scratch space (checkpoints, ...)
  std::string result_dir;  // this rank's own: files collected by the parent
  std::map<std::string, std::string> params;  // LaunchOptions::params

  // The parameter `key`, or `fallback` when it was not given.
  std::string Param(const std::string& key, const std::string& fallback = "") const;
  int64_t IntParam(const std::string& key, int64_t fallback) const;
};

using WorkerFunction = std::function<absl::Status(const WorkerContext&)>;

// Registers `fn` under `name` (at static-initialisation time; see MOED_WORKER).
bool RegisterWorker(const std::string& name, WorkerFunction fn);

#define MOED_WORKER(name, ctx_decl)                              \
  static ::absl::Status MoedWorker_##name(ctx_decl);             \
  static const bool moed_worker_registered_##name =              \
      ::moe::harness::RegisterWorker(#name, &MoedWorker_##name); \
  static ::absl::Status MoedWorker_##name(ctx_decl)

struct LaunchOptions {
  std::string worker;                         // registered function name (required)
  int size = 2;                               // number of ranks
  std::string binary;                         // default: this test binary (/proc/self/exe)
  std::map<std::string, std::string> params;  // passed to every rank (keys: [A-Za-z0-9_])
  // Per-rank parameters, merged over `params` for that rank (e.g. which rank should crash).
  std::map<int, std::map<std::string, std::string>> rank_params;
  absl::Duration deadline = absl::Seconds(60);  // then every rank still running is killed
  std::string work_dir;  // default: a fresh directory under $TEST_TMPDIR (or /tmp)
};

struct RankResult {
  int rank = 0;
  int exit_code = -1;  // the process's exit status, -1 if killed by a signal
  int signal = 0;      // the terminating signal, 0 if it exited
  bool killed_at_deadline = false;
  absl::Duration elapsed;   // from launch to exit
  std::string stderr_text;  // everything the rank wrote to stderr (and stdout)
  std::string result_dir;

  bool ok() const { return exit_code == 0 && signal == 0 && !killed_at_deadline; }
};

struct LaunchResult {
  std::vector<RankResult> ranks;  // indexed by rank
  std::string work_dir;
  std::string store_dir;

  bool AllSucceeded() const;
  // One paragraph per rank: exit status, time, and the tail of its stderr.
  std::string Summary() const;
};

// Starts the ranks, waits for all of them (killing those alive at the deadline) and collects
// them. An error only when the processes could not be started at all.
absl::StatusOr<LaunchResult> RunWorkers(const LaunchOptions& options);

// ---- result files ----
absl::Status WriteResult(const WorkerContext& ctx, const std::string& name,
                         const std::string& bytes);
absl::StatusOr<std::string> ReadResult(const RankResult& rank, const std::string& name);

template <typename T>
std::string EncodeValues(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}
template <typename T>
absl::StatusOr<std::vector<T>> DecodeValues(const std::string& bytes) {
  if (bytes.size() % sizeof(T) != 0) {
    return absl::DataLossError("result file size is not a multiple of the element size");
  }
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!bytes.empty()) std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

// Internal to :worker_main: if this process was started as a worker, runs it and returns its
// exit code; otherwise returns -1.
int MaybeRunAsWorker();

}  // namespace harness
}  // namespace moe

#endif  // MOED_TESTS_HARNESS_MULTIPROCESS_H_
