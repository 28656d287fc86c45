// moe-worker's side of the step rings (server/worker_rings.h is moed's): attaches to the ring
// channels moed created for a generation (Worker.OpenStepChannels, proto/worker.proto) and
// answers each with its own thread, running the handler it was given on every record on that
// thread (no hand-off to another thread per record)
// (transport/step_envelope.h: kind, deadline, the request's bytes).
//
// A channel is accepted only when its caller slot holds the pid moed declared and both share
// one pid namespace; the OpenStepChannels call itself carries the cluster secret (checked by
// AuthenticatedWorkerService), so a process without it cannot make the worker attach, and
// one that forged a region cannot pass the pid check. A channel's thread ends when moed closes
// it, within 250 ms of moed's death, when a newer generation's channels open, or on
// destruction.
//
//   WorkerRingServer rings([&](uint8_t kind, absl::Time deadline, absl::string_view body) {
//     return Serve(kind, deadline, body);
//   });
//   rings.Open(request, &response);  // in the OpenStepChannels handler
#ifndef MOED_SERVER_WORKER_RING_SERVER_H_
#define MOED_SERVER_WORKER_RING_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/worker.pb.h"
#include "transport/ring_channel.h"

namespace moe {

class WorkerRingServer {
 public:
  // The answer's bytes to a record of `kind` with `body`, or the status to answer. `deadline`
  // is the call's (the worker's step bodies ignore it, as their gRPC handlers ignore their
  // context's: a collective cannot be abandoned by one rank; moed gives up at it).
  using Handler = std::function<absl::StatusOr<std::string>(uint8_t kind, absl::Time deadline,
                                                            absl::string_view body)>;
  // max_spin: each channel thread's doorbell spin before it sleeps (transport/doorbell.h).
  explicit WorkerRingServer(Handler handler, absl::Duration max_spin = absl::ZeroDuration())
      : handler_(std::move(handler)), max_spin_(max_spin) {}
  ~WorkerRingServer();  // stops every channel and joins its thread

  // Attaches to request.names() (errors per name in *response), after stopping the channels of
  // older generations.
  void Open(const internal::OpenStepChannelsRequest& request,
            internal::OpenStepChannelsResponse* response);
  // Channels being served now (tests).
  int serving() const;

 private:
  struct Served {
    int64_t generation = 0;
    std::unique_ptr<RingChannel> channel;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  // A channel attached and checked, or why not.
  absl::StatusOr<std::unique_ptr<RingChannel>> Attach(
      const std::string& name, const internal::OpenStepChannelsRequest& request) const;
  // The record's answer: the envelope unwrapped, handler_ run.
  absl::StatusOr<std::string> Answer(absl::string_view record) const;
  void ServeChannel(Served* served) const;

  const Handler handler_;
  const absl::Duration max_spin_;
  mutable absl::Mutex mu_;
  std::list<std::unique_ptr<Served>> served_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_RING_SERVER_H_
