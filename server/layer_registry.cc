#include "server/layer_registry.h"

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/layer_info.h"

namespace moe {

absl::StatusOr<std::shared_ptr<LayerEntry>> LayerRegistry::Find(const std::string& name) const {
  RETURN_IF_ERROR(ValidateLayerName("layer", name));
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(name);
  if (it == layers_.end()) {
    return absl::NotFoundError(absl::StrCat("layer: no layer named \"", name, "\""));
  }
  return it->second;
}

absl::Status LayerRegistry::Add(const std::shared_ptr<LayerEntry>& layer) {
  absl::MutexLock lock(&mu_);
  if (layers_.count(layer->name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: a layer named \"", layer->name, "\" exists"));
  }
  if (static_cast<int64_t>(layers_.size()) >= max_layers_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "CreateLayer: ", layers_.size(), " layers exist, the most --max_layers=", max_layers_,
        " allows; delete a layer or start moed with a larger --max_layers"));
  }
  layers_[layer->name] = layer;
  return absl::OkStatus();
}

void LayerRegistry::Restore(const std::shared_ptr<LayerEntry>& layer) {
  absl::MutexLock lock(&mu_);
  layers_[layer->name] = layer;
}

absl::Status LayerRegistry::Remove(const std::shared_ptr<LayerEntry>& layer) {
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(layer->name);
  if (it == layers_.end() || it->second != layer) {
    return absl::NotFoundError(absl::StrCat("name: no layer named \"", layer->name, "\""));
  }
  layers_.erase(it);
  return absl::OkStatus();
}

bool LayerRegistry::Lists(const std::shared_ptr<LayerEntry>& layer) const {
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(layer->name);
  return it != layers_.end() && it->second == layer;
}

std::vector<std::shared_ptr<LayerEntry>> LayerRegistry::List() const {
  std::vector<std::shared_ptr<LayerEntry>> layers;
  absl::MutexLock lock(&mu_);
  layers.reserve(layers_.size());
  for (const auto& kv : layers_) layers.push_back(kv.second);
  return layers;
}

void LayerRegistry::ForEach(const std::function<void(LayerEntry&)>& visit) const {
  absl::MutexLock lock(&mu_);
  for (const auto& kv : layers_) visit(*kv.second);
}

int64_t LayerRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(layers_.size());
}

}  // namespace moe
