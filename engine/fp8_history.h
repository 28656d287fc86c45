// The amax histories of delayed FP8 scaling (docs/SPEC.md "FP8", "Delayed scaling"): one ring
// of fp8_amax_history_len floats per quantised activation or gradient tensor of the expert FFN
// (X, a, d_y, d_h) in backend memory, and on the host the steps each has recorded. A layer
// holds one; it is empty (nothing allocated, every call a no-op) unless the layer computes in
// FP8 with the delayed recipe. Its contents are layer state: "fp8.amax_history" [4, len] and
// "fp8.amax_steps" [4] (StateNames, checkpoints); Reset empties it (SetWeights).
//
//   ASSIGN_OR_RETURN(Fp8History history, Fp8History::Create(config, backend));
//   Fp8History::Slot slot;
//   RETURN_IF_ERROR(history.BeginStep(Fp8Tensor::kX, delayed_amax, &slot));
//   // slot.from_history: quantise with *delayed_amax; reduce this step's amax into slot.amax.
#ifndef MOED_ENGINE_FP8_HISTORY_H_
#define MOED_ENGINE_FP8_HISTORY_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/tensor.h"

namespace moe {

// The tensors with a history, in the order of the state's rows.
enum class Fp8Tensor { kX = 0, kAct = 1, kDy = 2, kDh = 3 };
inline constexpr int kFp8Tensors = 4;

class Fp8History {
 public:
  // State names (MoeLayer::StateNames).
  static constexpr const char* kHistoryName = "fp8.amax_history";
  static constexpr const char* kStepsName = "fp8.amax_steps";

  Fp8History() = default;
  // Empty unless config.compute_dtype is FP8 and config.fp8_recipe DELAYED; else the rings
  // allocated on `backend` and zeroed, no step recorded.
  static absl::StatusOr<Fp8History> Create(const LayerConfig& config, Backend* backend);

  bool enabled() const { return backend_ != nullptr; }

  // Where one step's quantisation of a tensor reads and writes.
  struct Slot {
    float* amax = nullptr;      // this step's ring slot (zeroed): reduce the step's amax here
    bool from_history = false;  // a step was recorded: the scale comes from *delayed_amax
  };
  // Claims tensor t's next slot: Backend::Fp8HistoryAmax writes the delayed amax to
  // *delayed_amax (backend memory) and zeroes the slot, and the step counts as recorded. On
  // an empty history nothing is enqueued and *slot is {}.
  absl::Status BeginStep(Fp8Tensor t, float* delayed_amax, Slot* slot);

  // No step recorded (the next scales from its own amax), the rings zeroed.
  absl::Status Reset();

  std::vector<std::string> StateNames() const;
  // kHistoryName: FP32 [4, len] (row t = tensor t's ring, slot i % len = step i's amax);
  // kStepsName: FP32 [4] (each < 2 len: min(steps, len) and steps % len are what counts).
  absl::StatusOr<Tensor> GetState(const std::string& name) const;
  // As GetState gives them; INVALID_ARGUMENT for another shape, a negative or NaN amax, or a
  // step count that is not an integer in [0, 2 len). NOT_FOUND for another name.
  absl::Status SetState(const std::string& name, const Tensor& value);

 private:
  Backend* backend_ = nullptr;
  int64_t len_ = 0;
  int margin_ = 0;
  bool most_recent_ = false;
  Buffer rings_;                              // float [kFp8Tensors, len_]
  std::array<int64_t, kFp8Tensors> steps_{};  // kept < 2 len_ (see GetState)
};

}  // namespace moe

#endif  // MOED_ENGINE_FP8_HISTORY_H_
