// moed's graceful stop (SIGTERM / SIGINT; issue 43): what it did to each layer, for the log.
// moed stops taking calls (MoeServiceImpl::BeginShutdown: new calls are UNAVAILABLE with
// kShuttingDownMessage, readiness NOT_SERVING), then MoeServiceImpl::PersistForShutdown takes
// every layer's turn once more (behind the calls already accepted, which finish), closes the
// layer and writes it into the durable store when it changed since its durable checkpoint.
// moed prints the report when that is done or, at a second signal or once --shutdown_grace_s
// passed, at once, naming the layers that were not persisted.
//
//   GracefulStopReport report;
//   service.BeginShutdown(&report);
//   std::thread persist([&] { service.PersistForShutdown(deadline, &report); });
//   ... once done, a second signal or the deadline:
//   for (const std::string& line : report.Summary()) std::fprintf(stderr, "%s\n", line.c_str());
#ifndef MOED_SERVER_GRACEFUL_STOP_H_
#define MOED_SERVER_GRACEFUL_STOP_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moe {

// What every call refused during a graceful stop answers (UNAVAILABLE).
inline constexpr char kShuttingDownMessage[] =
    "moed is shutting down (SIGTERM or SIGINT): it takes no new calls; retry against the next "
    "moed";

// Thread-safe: the layers' threads of PersistForShutdown write it while moed's main thread
// may read it.
class GracefulStopReport {
 public:
  enum class Outcome {
    kWaiting,         // its turn (behind its running calls) or its durable write not done yet
    kPersisted,       // written by this stop, at `step`
    kAlreadyDurable,  // unchanged since its durable checkpoint at `step`
    kNotDurable,      // moed has no --state_dir: nothing survives a restart
    kNotPersisted,    // `why`
  };
  void Set(const std::string& layer, Outcome outcome, int64_t step = 0, std::string why = "");
  // Every layer is done (none kWaiting).
  bool complete() const;
  // The log: one line per layer persisted or not persisted (a layer still waiting is not
  // persisted: its running call or its write did not finish), then a one-line count.
  std::vector<std::string> Summary() const;

 private:
  struct Entry {
    Outcome outcome = Outcome::kWaiting;
    int64_t step = 0;
    std::string why;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> layers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_GRACEFUL_STOP_H_
