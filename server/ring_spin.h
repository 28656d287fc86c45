// --ring_spin_us (moed and moe-worker): how long a thread waiting on a same-host step ring
// spins before it sleeps on the futex (transport/doorbell.h, adaptive up to this limit):
// moed's step channel threads waiting for a caller's record and moed waiting for a worker's
// answer, the worker's ring threads waiting for moed's records. Embedded workers inherit a
// value given to moed. 0 (the default): no spin (docs/DECISIONS.md "ring doorbell spin").
//
//   options.max_spin = RingSpinFromFlag();
//   child_flags += RingSpinFlagsForChild();
#ifndef MOED_SERVER_RING_SPIN_H_
#define MOED_SERVER_RING_SPIN_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace moe {

inline constexpr int64_t kMaxRingSpinUs = 10000;

// The flag's value (unchecked).
absl::Duration RingSpinFromFlag();
// INVALID_ARGUMENT naming the flag unless 0 <= spin <= kMaxRingSpinUs µs.
absl::Status CheckRingSpin(absl::Duration spin);
// "--ring_spin_us=N" for a child moe-worker when moed was given a value other than 0.
std::vector<std::string> RingSpinFlagsForChild();

}  // namespace moe

#endif  // MOED_SERVER_RING_SPIN_H_
