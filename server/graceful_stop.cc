#include "server/graceful_stop.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moe {

void GracefulStopReport::Set(const std::string& layer, Outcome outcome, int64_t step,
                             std::string why) {
  absl::MutexLock lock(&mu_);
  layers_[layer] = Entry{outcome, step, std::move(why)};
}

bool GracefulStopReport::complete() const {
  absl::MutexLock lock(&mu_);
  for (const auto& [name, entry] : layers_) {
    if (entry.outcome == Outcome::kWaiting) return false;
  }
  return true;
}

std::vector<std::string> GracefulStopReport::Summary() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> lines;
  int persisted = 0, durable = 0, not_durable = 0, lost = 0;
  for (const auto& [name, entry] : layers_) {
    switch (entry.outcome) {
      case Outcome::kPersisted:
        ++persisted;
        lines.push_back(
            absl::StrCat("moed: stop: layer ", name, ": persisted at optimizer step ", entry.step));
        break;
      case Outcome::kAlreadyDurable:
        ++durable;
        lines.push_back(absl::StrCat("moed: stop: layer ", name,
                                     ": unchanged since its durable optimizer step ", entry.step));
        break;
      case Outcome::kNotDurable:
        ++not_durable;
        break;
      case Outcome::kWaiting:
        ++lost;
        lines.push_back(absl::StrCat(
            "moed: stop: layer ", name,
            ": NOT persisted (its running call or its durable write had not finished)"));
        break;
      case Outcome::kNotPersisted:
        ++lost;
        lines.push_back(
            absl::StrCat("moed: stop: layer ", name, ": NOT persisted (", entry.why, ")"));
        break;
    }
  }
  lines.push_back(absl::StrCat("moed: stop: ", persisted, " layer(s) persisted, ", durable,
                               " already durable, ", lost, " NOT persisted, ", not_durable,
                               " not durable (no --state_dir)"));
  return lines;
}

}  // namespace moe
