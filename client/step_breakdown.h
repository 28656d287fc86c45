// StepBreakdown: the per-phase times of many steps (MoeClient's StepTimes), summarised as the
// JSON `moectl bench` prints: the median of every phase, the engine's share of the step and
// the transport's payload rate.
//
//   StepBreakdown fwd;
//   StepTimes times;
//   CallOptions call; call.timing = &times;
//   client->Forward(layer, x, false, call); fwd.Add(latency_ms, {&times});
//   std::printf("%s", fwd.Json().c_str());
#ifndef MOED_CLIENT_STEP_BREAKDOWN_H_
#define MOED_CLIENT_STEP_BREAKDOWN_H_

#include <string>
#include <vector>

#include "client/json_output.h"
#include "client/moe_client.h"

namespace moe {
namespace client {

class StepBreakdown {
 public:
  // One timed step: its wall time on the client and the StepTimes of each of its calls
  // (one for a forward, two for forward + backward; the phases are summed over them).
  void Add(double latency_ms, const std::vector<const StepTimes*>& calls);

  // ToJson: {"latency_ms", "client": {encode, call, decode}, "moed": {moed, queue, fanout, gather},
  //  "wire_and_reply_ms", "workers": [{call, handler, decode, engine, encode}...],
  //  "engine_ms", "service_over_engine", "payload_bytes", "payload_gb_per_s"}: medians over
  // the steps. engine_ms is the slowest worker's engine time; payload_gb_per_s is the bytes
  // in and out (x / d_out and out / d_x) over (latency - engine_ms).
  Json ToJson() const;

 private:
  struct Sample {
    double latency_ms = 0.0;
    StepTimes sum;  // phases summed over the step's calls
    double engine_ms = 0.0;
    double payload_bytes = 0.0;
  };
  std::vector<Sample> samples_;
};

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_STEP_BREAKDOWN_H_
