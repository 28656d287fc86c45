// LayerRegistry: the layers moed serves, by name (the front end's layer registry, issue 38
// §2). It lists each layer's LayerEntry (server/layer_entry.h), hands out the layer ids the
// workers know instances by, and enforces --max_layers. It calls no worker and takes no
// layer's turn: MoeServiceImpl creates a layer on the workers after listing it, and deletes
// it there after taking it off the list.
//
//   LayerRegistry registry(options.max_layers);
//   auto layer = std::make_shared<LayerEntry>(name, limits);
//   layer->id = registry.NextLayerId();
//   layer->config = config;
//   RETURN_IF_ERROR(registry.Add(layer));  // ALREADY_EXISTS, RESOURCE_EXHAUSTED
//   ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> found, registry.Find(name));  // NOT_FOUND
//   for (const auto& each : registry.List()) ...  // a snapshot, in name order
//   RETURN_IF_ERROR(registry.Remove(found));  // NOT_FOUND unless `found` is still listed
//
// Entries are compared by identity, not by name: a call keeps the entry it found, and
// Remove / Lists act only on that entry, never on another layer created later under the
// same name.
//
// Locking: the registry's own mutex is a leaf below admission control's lock
// (server/worker_memory_admission.h) and above every LayerEntry::mu (ForEach may take an
// entry's mu under it). It is never held while waiting for a layer's turn or a worker.
// Thread-safe.
#ifndef MOED_SERVER_LAYER_REGISTRY_H_
#define MOED_SERVER_LAYER_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/layer_entry.h"

namespace moe {

class LayerRegistry {
 public:
  // max_layers: the most layers Add lists at once (ServiceOptions::max_layers).
  explicit LayerRegistry(int64_t max_layers) : max_layers_(max_layers) {}
  LayerRegistry(const LayerRegistry&) = delete;
  LayerRegistry& operator=(const LayerRegistry&) = delete;

  // A fresh layer id (1, 2, ...), never reused by this registry: the workers tell a layer's
  // instances apart by it, across generations and across layers created under one name.
  uint64_t NextLayerId() { return next_layer_id_++; }

  // The entry listed under `name`. INVALID_ARGUMENT for a name ValidateLayerName refuses
  // (proto/layer_info.h; the field named "layer"), NOT_FOUND ("layer: no layer named ...")
  // when none is listed.
  absl::StatusOr<std::shared_ptr<LayerEntry>> Find(const std::string& name) const;

  // Lists `layer` (name, id and config set) under its name. ALREADY_EXISTS ("name: a layer
  // named ... exists") when a layer of that name is listed, else RESOURCE_EXHAUSTED naming
  // --max_layers when max_layers are listed; nothing changes then.
  absl::Status Add(const std::shared_ptr<LayerEntry>& layer);
  // Lists `layer` under its name past the limit, replacing any entry listed under it: the
  // durable store's layers at start (MoeServiceImpl::RestoreDurableLayers).
  void Restore(const std::shared_ptr<LayerEntry>& layer);

  // Takes `layer` off the list when it is the entry listed under its name; NOT_FOUND ("name:
  // no layer named ...") otherwise (removed meanwhile, maybe listed again as another entry,
  // which stays). Marks nothing: the caller sets layer->deleted (under the layer's turn).
  absl::Status Remove(const std::shared_ptr<LayerEntry>& layer);
  // Whether `layer` is the entry listed under its name now.
  bool Lists(const std::shared_ptr<LayerEntry>& layer) const;

  // The entries listed now, in name order: a snapshot, used without the registry's lock.
  std::vector<std::shared_ptr<LayerEntry>> List() const;
  // visit(entry) for every listed entry in name order, under the registry's lock (nothing is
  // added or removed meanwhile). `visit` may take the entry's mu; it must not call the
  // registry, wait for a turn or call a worker.
  void ForEach(const std::function<void(LayerEntry&)>& visit) const;
  int64_t size() const;

 private:
  const int64_t max_layers_;
  std::atomic<uint64_t> next_layer_id_{1};
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<LayerEntry>> layers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOED_SERVER_LAYER_REGISTRY_H_
