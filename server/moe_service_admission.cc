// MoeServiceImpl: admission control by estimated worker memory (--worker_memory_bytes).
//
// A CreateLayer, Forward or Backward is refused with RESOURCE_EXHAUSTED before any worker
// allocates when what it needs per worker (server/step_memory.h: the layer's shard, or the
// step's worst-case working memory) plus what the workers already hold (every layer's shard
// and the steps kept for backward) passes the budget. The check is made when the call
// arrives, before it waits for the layer's turn; steps of different layers that run at the
// same time are each checked alone, not summed.
#include <algorithm>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/moe_service.h"
#include "server/step_memory.h"

namespace moe {
namespace {

// The host part of a worker's "host:port" (the whole string when it has no port).
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

int64_t MoeServiceImpl::WorkerMemoryBudget(bool* derived) const {
  *derived = false;
  if (options_.worker_memory_bytes > 0) return options_.worker_memory_bytes;
  if (options_.worker_memory_bytes < 0) return 0;
  *derived = true;
  const std::vector<v1::WorkerStatus> workers = pool_->WorkerStatuses();
  // CPU workers on one host share its memory.
  std::map<std::string, int> cpu_workers_on;
  for (const v1::WorkerStatus& w : workers) {
    if (w.memory_capacity_bytes() > 0 && w.device().rfind("cuda", 0) != 0) {
      ++cpu_workers_on[HostOf(w.address())];
    }
  }
  long double budget = 0;
  bool any = false;
  for (const v1::WorkerStatus& w : workers) {
    if (w.memory_capacity_bytes() <= 0) continue;
    const long double capacity = static_cast<long double>(w.memory_capacity_bytes());
    const long double share = w.device().rfind("cuda", 0) == 0
                                  ? capacity * 0.9L
                                  : capacity * 0.8L / cpu_workers_on[HostOf(w.address())];
    budget = any ? std::min(budget, share) : share;
    any = true;
  }
  return any ? static_cast<int64_t>(budget) : 0;
}

int64_t MoeServiceImpl::HeldWorkerBytes() const {
  std::vector<std::shared_ptr<Layer>> layers;
  {
    absl::MutexLock lock(&layers_mu_);
    for (const auto& kv : layers_) layers.push_back(kv.second);
  }
  const int ranks = std::max(pool_->world_size(), 1);
  long double held = 0;
  for (const auto& layer : layers) {
    held += static_cast<long double>(LayerBytesPerWorker(layer->config, ranks));
    absl::MutexLock lock(&layer->mu);
    held += static_cast<long double>(layer->saved.bytes()) / ranks;
  }
  return held >= static_cast<long double>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(held);
}

absl::Status MoeServiceImpl::AdmitWorkerMemory(absl::string_view call, absl::string_view layer,
                                               int64_t tokens, int64_t need) const {
  bool derived = false;
  const int64_t budget = WorkerMemoryBudget(&derived);
  if (budget <= 0) return absl::OkStatus();
  const int64_t held = HeldWorkerBytes();
  if (static_cast<long double>(held) + static_cast<long double>(need) <=
      static_cast<long double>(budget)) {
    return absl::OkStatus();
  }
  const std::string what =
      tokens < 0 ? absl::StrCat(call, " of layer \"", layer, "\"")
                 : absl::StrCat(call, " of ", tokens, " tokens on layer \"", layer, "\"");
  return absl::ResourceExhaustedError(absl::StrCat(
      what, " needs an estimated ", need,
      " bytes per worker (worst case; server/step_memory.h), and the workers hold ", held,
      " already (layers' parameters, gradients and optimizer state; steps kept for backward); "
      "the limit is ",
      budget, " bytes per worker (--worker_memory_bytes",
      derived ? ", derived from the memory the workers report" : "",
      "). Nothing ran: send fewer tokens per call, release kept steps or delete layers, or raise "
      "--worker_memory_bytes"));
}

}  // namespace moe
