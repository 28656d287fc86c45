// PhaseClock: wall-clock laps of a step's phases, for the StepTiming of a Forward/Backward
// that asks for it (proto/moe.proto). A disabled clock reads no clock and returns 0.
//
//   PhaseClock clock(request->timing());
//   DecodeInput();
//   timing->set_decode_ms(clock.Lap());   // ms since construction or the previous Lap
//   RunEngine();
//   timing->set_engine_ms(clock.Lap());
#ifndef MOED_BASE_PHASE_CLOCK_H_
#define MOED_BASE_PHASE_CLOCK_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moe {

class PhaseClock {
 public:
  explicit PhaseClock(bool enabled) : enabled_(enabled) {
    if (enabled_) start_ = last_ = absl::Now();
  }
  bool enabled() const { return enabled_; }
  // Milliseconds since the previous Lap (or construction).
  double Lap() {
    if (!enabled_) return 0.0;
    const absl::Time now = absl::Now();
    const double ms = absl::ToDoubleMilliseconds(now - last_);
    last_ = now;
    return ms;
  }
  // Milliseconds since construction.
  double Total() const { return enabled_ ? absl::ToDoubleMilliseconds(absl::Now() - start_) : 0.0; }

 private:
  const bool enabled_;
  absl::Time start_;
  absl::Time last_;
};

}  // namespace moe

#endif  // MOED_BASE_PHASE_CLOCK_H_
