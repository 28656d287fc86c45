// moectl forward and backward: one step through the service with a random input or a .npy
// file, the result written to .npy.
#include <cstdio>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/json_output.h"
#include "client/moectl.h"
#include "client/npy.h"
#include "client/tensor_util.h"

ABSL_FLAG(std::string, input, "", "forward: x from this .npy file ([T, H]) instead of random.");
ABSL_FLAG(std::string, output, "", "forward / backward: write out / d_x to this .npy file.");
ABSL_FLAG(bool, keep_for_backward, false,
          "forward: keep the step on the server for a later `moectl backward --step_id`.");
ABSL_FLAG(uint64_t, step_id, 0, "backward: the step_id printed by forward --keep_for_backward.");
ABSL_FLAG(std::string, d_out, "", "backward: d_out from this .npy file instead of random.");
ABSL_FLAG(std::string, d_aux, "", "backward: gradient w.r.t. the aux loss (empty = server's 1).");
ABSL_FLAG(std::string, d_z_loss, "", "backward: gradient w.r.t. the z-loss (empty = server's 1).");

namespace moe {
namespace client {
namespace cli {
namespace {

// x (or d_out) from `path` (float32/float64 files converted to --dtype), else random
// [--tokens, hidden] of --dtype.
absl::StatusOr<Tensor> InputTensor(const std::string& path, int64_t hidden, uint64_t seed) {
  auto dtype = InputDTypeFromFlag();
  if (!dtype.ok()) return dtype.status();
  if (!path.empty()) {
    auto t = ReadNpy(path);
    if (!t.ok()) return t.status();
    // Floating files become --dtype (NumPy's default float64 included); others go as stored
    // and the server says what it accepts.
    if (t->dtype() == DType::kFloat32 || t->dtype() == DType::kFloat64) {
      return t->ConvertTo(*dtype);
    }
    return t;
  }
  absl::Status tokens_ok = CheckTokensFlag(hidden, *dtype);  // Run* checked it already
  if (!tokens_ok.ok()) return tokens_ok;
  return RandomNormal(*dtype, {absl::GetFlag(FLAGS_tokens), hidden}, seed);
}

absl::StatusOr<std::optional<double>> OptionalDouble(absl::string_view flag,
                                                     const std::string& text) {
  if (text.empty()) return std::optional<double>();
  double value = 0;
  if (!absl::SimpleAtod(text, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", text, "' is not a number"));
  }
  return std::optional<double>(value);
}

}  // namespace

int RunForward(const Args& args) {
  if (!args.empty()) return UsageError("forward", "takes no positional arguments");
  const std::string layer = absl::GetFlag(FLAGS_layer);
  if (layer.empty()) return UsageError("forward", "--layer is required");
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("forward", client.status());
  // The hidden size of a random input comes from the layer itself.
  int64_t hidden = 0;
  if (absl::GetFlag(FLAGS_input).empty()) {
    auto info = (*client)->GetLayer(layer);
    if (!info.ok()) return ReportError("forward", info.status());
    hidden = info->config().hidden();
    auto dtype = InputDTypeFromFlag();
    if (!dtype.ok()) return UsageError("forward", dtype.status().message());
    absl::Status tokens_ok = CheckTokensFlag(hidden, *dtype);
    if (!tokens_ok.ok()) return UsageError("forward", tokens_ok.message());
  }
  auto x = InputTensor(absl::GetFlag(FLAGS_input), hidden, absl::GetFlag(FLAGS_input_seed));
  if (!x.ok()) return LocalError("forward", "--input", x.status());
  auto result = (*client)->Forward(layer, *x, absl::GetFlag(FLAGS_keep_for_backward));
  if (!result.ok()) return ReportError("forward", result.status());
  const std::string output = absl::GetFlag(FLAGS_output);
  if (!output.empty()) {
    absl::Status written = WriteNpy(output, result->out);
    if (!written.ok()) return LocalError("forward", "--output", written);
  }
  Json out;
  out["layer"] = layer;
  out["tokens"] = x->rank() > 0 ? x->dim(0) : 0;
  out["datatype"] = DTypeName(x->dtype());
  out["out_shape"] = result->out.ShapeString();
  out["aux_loss"] = result->aux_loss;
  out["z_loss"] = result->z_loss;
  out["step_id"] = result->step_id;
  out["tokens_per_expert"] = result->tokens_per_expert;
  out["output"] = output;
  PrintJson(out);
  return 0;
}

int RunBackward(const Args& args) {
  if (!args.empty()) return UsageError("backward", "takes no positional arguments");
  const std::string layer = absl::GetFlag(FLAGS_layer);
  if (layer.empty()) return UsageError("backward", "--layer is required");
  const uint64_t step_id = absl::GetFlag(FLAGS_step_id);
  if (step_id == 0) {
    return UsageError("backward", "--step_id is required (from forward --keep_for_backward)");
  }
  auto d_aux = OptionalDouble("d_aux", absl::GetFlag(FLAGS_d_aux));
  if (!d_aux.ok()) return UsageError("backward", d_aux.status().message());
  auto d_z = OptionalDouble("d_z_loss", absl::GetFlag(FLAGS_d_z_loss));
  if (!d_z.ok()) return UsageError("backward", d_z.status().message());
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("backward", client.status());
  int64_t hidden = 0;
  if (absl::GetFlag(FLAGS_d_out).empty()) {
    auto info = (*client)->GetLayer(layer);
    if (!info.ok()) return ReportError("backward", info.status());
    hidden = info->config().hidden();
    auto dtype = InputDTypeFromFlag();
    if (!dtype.ok()) return UsageError("backward", dtype.status().message());
    absl::Status tokens_ok = CheckTokensFlag(hidden, *dtype);
    if (!tokens_ok.ok()) return UsageError("backward", tokens_ok.message());
  }
  // A random d_out uses the next seed after x's, so forward+backward with the same
  // --input_seed never reuse x as d_out.
  auto d_out = InputTensor(absl::GetFlag(FLAGS_d_out), hidden, absl::GetFlag(FLAGS_input_seed) + 1);
  if (!d_out.ok()) return LocalError("backward", "--d_out", d_out.status());
  auto d_x = (*client)->Backward(layer, step_id, *d_out, *d_aux, *d_z);
  if (!d_x.ok()) return ReportError("backward", d_x.status());
  const std::string output = absl::GetFlag(FLAGS_output);
  if (!output.empty()) {
    absl::Status written = WriteNpy(output, *d_x);
    if (!written.ok()) return LocalError("backward", "--output", written);
  }
  PrintJson(Json{{"layer", layer},
                 {"step_id", step_id},
                 {"d_x_shape", d_x->ShapeString()},
                 {"output", output}});
  return 0;
}

}  // namespace cli
}  // namespace client
}  // namespace moe
