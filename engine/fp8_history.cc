#include "engine/fp8_history.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {

absl::StatusOr<Fp8History> Fp8History::Create(const LayerConfig& config, Backend* backend) {
  Fp8History h;
  if (config.compute_dtype != DType::kFloat8E4M3 || config.fp8_recipe != Fp8Recipe::kDelayed) {
    return h;
  }
  h.len_ = config.fp8_amax_history_len;
  h.margin_ = static_cast<int>(config.fp8_margin);
  h.most_recent_ = config.fp8_amax_compute_algo == Fp8AmaxAlgo::kMostRecent;
  ASSIGN_OR_RETURN(h.rings_, backend->Allocate(kFp8Tensors * h.len_ * sizeof(float)));
  h.backend_ = backend;
  RETURN_IF_ERROR(h.Reset());
  return h;
}

absl::Status Fp8History::BeginStep(Fp8Tensor t, float* delayed_amax, Slot* slot) {
  *slot = Slot{};
  if (!enabled()) return absl::OkStatus();
  int64_t& steps = steps_[static_cast<int>(t)];
  Fp8HistoryArgs args;
  args.history = rings_.as<float>() + static_cast<int64_t>(t) * len_;
  args.len = len_, args.steps = steps, args.margin = margin_, args.most_recent = most_recent_;
  args.amax = delayed_amax;
  RETURN_IF_ERROR(backend_->Fp8HistoryAmax(args));
  slot->amax = args.history + steps % len_;
  slot->from_history = steps > 0;
  steps = steps + 1 < 2 * len_ ? steps + 1 : len_ + (steps + 1) % len_;
  return absl::OkStatus();
}

absl::Status Fp8History::Reset() {
  steps_.fill(0);
  if (!enabled()) return absl::OkStatus();
  return backend_->Memset(rings_.data(), 0, rings_.size());
}

std::vector<std::string> Fp8History::StateNames() const {
  if (!enabled()) return {};
  return {kHistoryName, kStepsName};
}

absl::StatusOr<Tensor> Fp8History::GetState(const std::string& name) const {
  if (enabled() && name == kHistoryName) {
    std::vector<float> host(kFp8Tensors * len_);
    RETURN_IF_ERROR(backend_->CopyToHost(host.data(), rings_.data(), rings_.size()));
    return Tensor::FromFloats({kFp8Tensors, len_}, host);
  }
  if (enabled() && name == kStepsName) {
    std::vector<float> steps(steps_.begin(), steps_.end());
    return Tensor::FromFloats({kFp8Tensors}, steps);
  }
  return absl::NotFoundError(absl::StrCat("state '", name, "' does not exist"));
}

absl::Status Fp8History::SetState(const std::string& name, const Tensor& value) {
  if (!enabled() || (name != kHistoryName && name != kStepsName)) {
    return absl::NotFoundError(absl::StrCat("state '", name, "' does not exist"));
  }
  const bool history = name == kHistoryName;
  RETURN_IF_ERROR(CheckShape(
      name, value.shape(),
      history ? std::vector<int64_t>{kFp8Tensors, len_} : std::vector<int64_t>{kFp8Tensors}));
  const Tensor f32 = value.ConvertTo(DType::kFloat32);
  const float* v = static_cast<const float*>(f32.raw());
  if (history) {
    for (int64_t i = 0; i < f32.num_elements(); ++i) {
      if (!(v[i] >= 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": an amax must be >= 0 (not NaN), got ", v[i], " at ", i));
      }
    }
    RETURN_IF_ERROR(backend_->CopyFromHost(rings_.data(), v, rings_.size()));
    return backend_->Synchronize();
  }
  std::array<int64_t, kFp8Tensors> steps{};
  for (int t = 0; t < kFp8Tensors; ++t) {
    if (!(v[t] >= 0) || v[t] >= 2 * len_ || v[t] != std::floor(v[t])) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": step counts must be integers in [0, ", 2 * len_, "), got ", v[t]));
    }
    steps[t] = static_cast<int64_t>(v[t]);
  }
  steps_ = steps;
  return absl::OkStatus();
}

}  // namespace moe
