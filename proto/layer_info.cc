#include "proto/layer_info.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

}  // namespace

absl::Status ValidateLayerName(absl::string_view field, absl::string_view name) {
  if (name.empty()) return Invalid(field, "required");
  if (name.size() > 128) return Invalid(field, "longer than 128 characters");
  for (char ch : name) {
    bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '_' || ch == '.' || ch == '-';
    if (!ok) return Invalid(field, "only [A-Za-z0-9_.-] allowed");
  }
  return absl::OkStatus();
}

std::vector<ParameterLayout> LayerParameters(const LayerConfig& c) {
  const int64_t up = UpWidth(c);
  std::vector<ParameterLayout> out;
  out.push_back({"gate", {c.hidden, c.num_experts}, false, true});
  if (c.use_expert_bias) out.push_back({"expert_bias", {c.num_experts}, false, false});
  out.push_back({"wi", {c.num_experts, c.hidden, up}, true, true});
  out.push_back({"wo", {c.num_experts, c.ffn, c.hidden}, true, true});
  if (c.use_bias) {
    out.push_back({"wi_bias", {c.num_experts, up}, true, true});
    out.push_back({"wo_bias", {c.num_experts, c.hidden}, true, true});
  }
  return out;
}

v1::ExpertLoad ComputeLoad(const std::vector<int64_t>& counts) {
  v1::ExpertLoad load;
  int64_t total = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    load.add_tokens_per_expert(counts[e]);
    if (counts[e] == 0) load.add_idle_experts(static_cast<int64_t>(e));
    total += counts[e];
  }
  if (!counts.empty() && total > 0) {
    load.set_min_tokens(*std::min_element(counts.begin(), counts.end()));
    load.set_max_tokens(*std::max_element(counts.begin(), counts.end()));
    load.set_mean_tokens(static_cast<double>(total) / static_cast<double>(counts.size()));
  }
  return load;
}

}  // namespace moe
