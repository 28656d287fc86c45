// moectl smoke: one training step through the service, checked against the same step run
// in-process on the local CPU engine (EP=1, engine/moe_layer.h).
//
// The service spreads the experts over its workers; the reference holds them all. docs/SPEC.md
// guarantees the same initial weights for any number of ranks (compared bitwise here) and
// EP=1 vs EP=R agreement up to floating-point reassociation, hence the tolerance on
// everything computed.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/layer_flags.h"
#include "client/json_output.h"
#include "client/moectl.h"
#include "client/tensor_util.h"
#include "engine/comm/local_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/moe_layer.h"
#include "proto/config_convert.h"

ABSL_FLAG(double, rtol, 0.0,
          "smoke: largest max relative error accepted (0 = 1e-4 for fp32, 3e-2 with bf16).");
ABSL_FLAG(bool, keep_layer, false, "smoke: leave the layer on the server afterwards.");

namespace moe {
namespace client {
namespace cli {
namespace {

struct Check {
  std::string name;
  std::string detail;  // e.g. shape or values
  double error = 0.0;
  double tolerance = 0.0;
  bool pass() const { return error <= tolerance; }
};

// Everything of the step on one side (remote or local).
struct StepResult {
  Tensor out;
  double aux_loss = 0.0;
  double z_loss = 0.0;
  std::vector<int64_t> tokens_per_expert;
  Tensor d_x;
  std::vector<NamedTensor> weights;    // before the step
  std::vector<NamedTensor> gradients;  // after the backward
};

absl::StatusOr<StepResult> RunLocal(const LayerConfig& config, const Tensor& x, const Tensor& d_out,
                                    const std::vector<NamedTensor>& remote_weights,
                                    const std::vector<NamedTensor>& remote_gradients) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::unique_ptr<Communicator> comm = MakeLocalCommunicator(MemorySpace::kHost);
  auto layer = MoeLayer::Create(config, backend.get(), comm.get());
  if (!layer.ok()) return layer.status();
  StepResult result;
  for (const NamedTensor& w : remote_weights) {
    auto value = (*layer)->GetParameter(w.name);
    if (!value.ok()) return value.status();
    result.weights.push_back({w.name, *std::move(value)});
  }
  std::unique_ptr<StepContext> saved;
  auto forward = (*layer)->Forward(x, &saved);
  if (!forward.ok()) return forward.status();
  result.out = std::move(forward->out);
  result.aux_loss = forward->aux_loss;
  result.z_loss = forward->z_loss;
  result.tokens_per_expert = forward->tokens_per_expert;
  auto d_x = (*layer)->Backward(*saved, d_out, 1.0, 1.0);
  if (!d_x.ok()) return d_x.status();
  result.d_x = *std::move(d_x);
  for (const NamedTensor& g : remote_gradients) {
    auto value = (*layer)->GetGradient(g.name);
    if (!value.ok()) return value.status();
    result.gradients.push_back({g.name, *std::move(value)});
  }
  return result;
}

absl::StatusOr<StepResult> RunRemote(MoeClient& client, const std::string& layer, const Tensor& x,
                                     const Tensor& d_out) {
  StepResult result;
  auto weights = client.GetWeights(layer);
  if (!weights.ok()) return weights.status();
  result.weights = *std::move(weights);
  auto forward = client.Forward(layer, x, /*keep_for_backward=*/true);
  if (!forward.ok()) return forward.status();
  result.out = std::move(forward->out);
  result.aux_loss = forward->aux_loss;
  result.z_loss = forward->z_loss;
  result.tokens_per_expert = forward->tokens_per_expert;
  auto d_x = client.Backward(layer, forward->step_id, d_out, 1.0, 1.0);
  if (!d_x.ok()) return d_x.status();
  result.d_x = *std::move(d_x);
  auto gradients = client.GetGradients(layer);
  if (!gradients.ok()) return gradients.status();
  result.gradients = *std::move(gradients);
  return result;
}

absl::StatusOr<std::vector<Check>> Compare(const StepResult& remote, const StepResult& local,
                                           double rtol) {
  std::vector<Check> checks;
  const auto tensor_check = [&](const std::string& name, const Tensor& a, const Tensor& b,
                                double tolerance) -> absl::Status {
    auto error = MaxRelError(a, b);
    if (!error.ok()) {
      return absl::InternalError(absl::StrCat(name, ": ", error.status().message()));
    }
    checks.push_back({name, a.ShapeString(), *error, tolerance});
    return absl::OkStatus();
  };
  // Initial weights: the same seed gives the same layer at any EP size, bit for bit.
  for (size_t i = 0; i < remote.weights.size(); ++i) {
    absl::Status s = tensor_check("weight " + remote.weights[i].name, remote.weights[i].tensor,
                                  local.weights[i].tensor, 0.0);
    if (!s.ok()) return s;
  }
  absl::Status s = tensor_check("out", remote.out, local.out, rtol);
  if (!s.ok()) return s;
  checks.push_back({"aux_loss",
                    absl::StrFormat("%.6g (local %.6g)", remote.aux_loss, local.aux_loss),
                    ScalarRelError(remote.aux_loss, local.aux_loss), rtol});
  checks.push_back({"z_loss", absl::StrFormat("%.6g (local %.6g)", remote.z_loss, local.z_loss),
                    ScalarRelError(remote.z_loss, local.z_loss), rtol});
  // Routing is discrete: the counts must agree exactly (a near-tie flipped by reassociation
  // would show here first).
  checks.push_back({"tokens_per_expert",
                    absl::StrCat("[", absl::StrJoin(remote.tokens_per_expert, " "), "]"),
                    remote.tokens_per_expert == local.tokens_per_expert ? 0.0 : 1.0, 0.0});
  s = tensor_check("d_x", remote.d_x, local.d_x, rtol);
  if (!s.ok()) return s;
  for (size_t i = 0; i < remote.gradients.size(); ++i) {
    s = tensor_check("grad " + remote.gradients[i].name, remote.gradients[i].tensor,
                     local.gradients[i].tensor, rtol);
    if (!s.ok()) return s;
  }
  return checks;
}

}  // namespace

int RunSmoke(const Args& args) {
  if (!args.empty()) return UsageError("smoke", "takes no positional arguments");
  auto config_proto = LayerConfigFromFlags();
  if (!config_proto.ok()) return UsageError("smoke", config_proto.status().message());
  auto dtype = InputDTypeFromFlag();
  if (!dtype.ok()) return UsageError("smoke", dtype.status().message());
  absl::Status tokens_ok = CheckTokensFlag(config_proto->hidden(), *dtype);
  if (!tokens_ok.ok()) return UsageError("smoke", tokens_ok.message());
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("smoke", client.status());

  const std::string name = LayerNameOr("smoke");
  auto info = (*client)->CreateLayer(name, *config_proto);
  if (!info.ok()) return ReportError("smoke", info.status());
  // The temporary layer goes on every way out (unless --keep_layer); it is deleted as soon as
  // the remote steps are done.
  bool layer_deleted = absl::GetFlag(FLAGS_keep_layer);
  auto delete_layer = [&] {
    if (!layer_deleted) (*client)->DeleteLayer(name).IgnoreError();
    layer_deleted = true;
  };
  absl::Cleanup delete_on_exit = delete_layer;
  // The config as the server applied it (defaults filled) drives the local reference.
  auto config = ConfigFromProto(info->config());
  if (!config.ok()) return ReportError("smoke", config.status());

  const uint64_t seed = absl::GetFlag(FLAGS_input_seed);
  const Tensor x = RandomNormal(*dtype, {tokens, config->hidden}, seed);
  const Tensor d_out = RandomNormal(*dtype, {tokens, config->hidden}, seed + 1);

  auto remote = RunRemote(**client, name, x, d_out);
  delete_layer();
  if (!remote.ok()) return ReportError("smoke", remote.status());
  auto local = RunLocal(*config, x, d_out, remote->weights, remote->gradients);
  if (!local.ok()) {
    return ReportError("smoke",
                       absl::Status(local.status().code(),
                                    absl::StrCat("local engine: ", local.status().message())));
  }
  double rtol = absl::GetFlag(FLAGS_rtol);
  if (rtol <= 0) {
    // The remote and the local engine compute the same recipe; they differ by summation order
    // (a GPU against the CPU), which FP8's coarser rounding of GEMM inputs amplifies.
    const bool bf16 = *dtype == DType::kBFloat16 || config->compute_dtype == DType::kBFloat16;
    rtol = config->compute_dtype == DType::kFloat8E4M3 ? 5e-2 : bf16 ? 3e-2 : 1e-4;
  }
  auto checks = Compare(*remote, *local, rtol);
  if (!checks.ok()) return ReportError("smoke", checks.status());

  bool pass = true;
  double worst = 0.0;
  for (const Check& c : *checks) {
    pass = pass && c.pass();
    worst = std::max(worst, c.error);
  }
  if (absl::GetFlag(FLAGS_json)) {
    Json items = Json::array();
    for (const Check& c : *checks) {
      items.push_back({{"name", c.name},
                       {"max_rel_error", c.error},
                       {"tolerance", c.tolerance},
                       {"pass", c.pass()}});
    }
    Json out;
    out["verdict"] = pass ? "PASS" : "FAIL";
    out["server"] = (*client)->target();
    out["layer"] = name;
    out["ep_ranks"] = info->ep_ranks();
    out["config"] = DescribeLayerConfig(info->config());
    out["tokens"] = tokens;
    out["datatype"] = DTypeName(*dtype);
    out["aux_loss"] = remote->aux_loss;
    out["z_loss"] = remote->z_loss;
    out["max_rel_error"] = worst;
    out["checks"] = std::move(items);
    PrintJson(out);
  } else {
    std::printf("moectl smoke: server %s, layer %s over %d workers\n", (*client)->target().c_str(),
                name.c_str(), info->ep_ranks());
    std::printf("  config  %s\n", DescribeLayerConfig(info->config()).c_str());
    std::printf("  input   %lld tokens, %s, seed %llu; one forward + backward, d_aux = d_z = 1\n",
                static_cast<long long>(tokens), DTypeName(*dtype),
                static_cast<unsigned long long>(seed));
    std::printf("  %-22s %-34s %12s %10s\n", "check", "service vs local engine", "max rel err",
                "tolerance");
    for (const Check& c : *checks) {
      std::printf("  %-22s %-34.34s %12.3g %10.3g  %s\n", c.name.c_str(), c.detail.c_str(), c.error,
                  c.tolerance, c.pass() ? "ok" : "MISMATCH");
    }
    std::printf("verdict: %s (%zu checks, max rel error %.3g)\n", pass ? "PASS" : "FAIL",
                checks->size(), worst);
  }
  return pass ? 0 : 1;
}

}  // namespace cli
}  // namespace client
}  // namespace moe
