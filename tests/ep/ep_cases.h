// Shared pieces of the expert-parallel tests: the cases (configs, token slicing, inputs), one
// step of a layer on a slice of the global batch, and the EP=1 reference that an EP=R run is
// compared with.
//
// A case fixes a global batch x [T_g, H], d_out [T_g, H], d_aux, d_zl and extra parameters
// (random biases, expert bias, a gate pushed toward one rank's experts) from its seed. Under
// EP=R rank r takes the contiguous token slice [offsets[r], offsets[r+1]).
//
// The reference (see EpReference): without capacity, one EP=1 run on the whole batch. With
// capacity, SPEC Forward 7 computes the capacity per rank from that rank's T, so EP=R drops
// per slice; the reference then is the sum, by linearity of the gradients in (d_out, d_aux,
// d_zl), of EP=1 runs on each slice with d_aux = d_zl = 0 (outputs, d_x, expert and the
// d_out part of the gate gradients: exactly what rank r computes for its own tokens) and one
// EP=1 run on the whole batch with d_out = 0 (aux/z-loss values and their gradients, which
// use T_g and the global counts before drops and so do not depend on capacity).
//
//   for (const EpCase& c : EpCases(ranks)) {
//     ASSIGN_OR_RETURN(StepResult r, RunStep(c, comm, begin, end, c.d_aux, c.d_zl, false));
//   }
#ifndef MOED_TESTS_EP_EP_CASES_H_
#define MOED_TESTS_EP_EP_CASES_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/comm/communicator.h"
#include "engine/config.h"
#include "engine/moe_layer.h"
#include "engine/tensor.h"

namespace moe {
namespace ep_test {

enum class Slicing {
  kUneven,    // rank r gets about (r + 1) / sum parts: every rank a different T
  kZeroRank,  // rank 1 (rank 0 at R = 1) gets no tokens, the rest uneven
};

struct EpCase {
  std::string name;
  LayerConfig config;
  int64_t global_tokens = 0;
  Slicing slicing = Slicing::kUneven;
  // When > 0: inputs are positive and the gate columns of experts [0, hot_experts) get
  // +hot_gate_boost, so every token picks among them. EpCases sets hot_experts = E / R: all
  // tokens go to rank 0's experts.
  int64_t hot_experts = 0;
  float hot_gate_boost = 1.0f;
  uint64_t data_seed = 1;
  double d_aux = 0.7;
  double d_zl = 1.3;
  // Also compare a second forward after an SGD step (only without capacity, where the
  // reference is one EP=1 run).
  bool second_step = false;
  // Max-norm relative error allowed against the EP=1 reference: fp32 reassociation only, or
  // bf16 rounding of rows that may round differently when the GEMM row groups differ.
  double tolerance = 1e-5;
};

// The cases run at EP = `ranks` (some of their parameters depend on R, e.g. the hot experts).
std::vector<EpCase> EpCases(int ranks);

// [R + 1] token offsets of the slices.
std::vector<int64_t> SliceOffsets(const EpCase& c, int ranks);

// x [T_g, H] and d_out [T_g, H] of a case (fp32, deterministic in data_seed).
std::vector<float> CaseInput(const EpCase& c);
std::vector<float> CaseOutputGradient(const EpCase& c);

// What one rank computes in a step, plus its shard of every gradient.
struct StepResult {
  std::vector<float> out;  // [T, H]
  double aux_loss = 0.0;
  double z_loss = 0.0;
  std::vector<int64_t> tokens_per_expert;  // [E]
  std::vector<float> d_x;                  // [T, H]
  // Gradients by parameter name, this rank's shard: "gate" [H, E], "wi" [El, H, up], ...
  std::map<std::string, std::vector<float>> grads;
  std::vector<float> out_after_step;  // second_step only: out of a forward after SGD
  // use_expert_bias only: expert_bias after UpdateExpertBias(0.01) over this run's forwards.
  std::vector<float> expert_bias_after;
};

// The case's parameters beyond the seeded initialisation: non-zero biases (zero at init, so
// they would test nothing), a random expert bias, and the hot gate columns.
absl::Status SetCaseParameters(const EpCase& c, MoeLayer* layer);

// Rows [begin, end) of the case's x or d_out as a [end - begin, H] tensor.
Tensor CaseRows(const EpCase& c, const std::vector<float>& values, int64_t begin, int64_t end);

// Creates the case's layer on `comm` (CPU backend), sets the case's extra parameters, runs
// Forward + Backward on tokens [begin, end) of the global batch with the given loss
// gradients (d_out zero when zero_d_out), and collects the results.
absl::StatusOr<StepResult> RunStep(const EpCase& c, Communicator* comm, int64_t begin, int64_t end,
                                   double d_aux, double d_zl, bool zero_d_out);

// The EP=1 reference for rank `rank` of an EP=`ranks` run, per the header comment. Gradients
// of expert tensors are whole ([E, ...]); EP ranks' shards are compared against their rows.
absl::StatusOr<std::vector<StepResult>> EpReference(const EpCase& c, int ranks);

// Parameter names with a gradient, for a case's config.
std::vector<std::string> GradientNames(const LayerConfig& config);
bool IsExpertTensor(const std::string& name);

// max |a - b| / max(max |b|, 1e-30); +inf on a size mismatch.
double MaxRelativeError(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace ep_test
}  // namespace moe

#endif  // MOED_TESTS_EP_EP_CASES_H_
