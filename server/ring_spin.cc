#include "server/ring_spin.h"

#include <cstdint>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int64_t, ring_spin_us, 0,
          "same-host step rings: spin up to this many microseconds before sleeping on the "
          "futex while waiting for the peer (adaptive; server/ring_spin.h). moed: its step "
          "channels and its rings to the workers; moe-worker: its ring threads (embedded "
          "workers get moed's value). Costs a core while it spins; 0: never spin");

namespace moe {

absl::Duration RingSpinFromFlag() {
  return absl::Microseconds(absl::GetFlag(FLAGS_ring_spin_us));
}

absl::Status CheckRingSpin(absl::Duration spin) {
  if (spin < absl::ZeroDuration() || spin > absl::Microseconds(kMaxRingSpinUs)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ring_spin_us must be in [0, ", kMaxRingSpinUs, "], got ",
                     absl::ToInt64Microseconds(spin)));
  }
  return absl::OkStatus();
}

std::vector<std::string> RingSpinFlagsForChild() {
  const int64_t us = absl::GetFlag(FLAGS_ring_spin_us);
  if (us == 0) return {};
  return {absl::StrCat("--ring_spin_us=", us)};
}

}  // namespace moe
