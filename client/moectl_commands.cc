// moectl subcommands that manage the service: health, status, layers, checkpoints.
#include <cstdio>
#include <optional>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/json_output.h"
#include "client/layer_flags.h"
#include "client/moectl.h"

ABSL_FLAG(int64_t, wait_ms, 0,
          "health: keep checking until SERVING or this many milliseconds have passed.");
ABSL_FLAG(std::string, service, "",
          "health: grpc.health.v1 name to check: \"\" (the whole server: moed SERVING = every "
          "worker up; moe-worker: joined and set up), a service name, or \"liveness\" (the "
          "process runs).");
ABSL_FLAG(bool, json, false, "status, smoke: print JSON instead of text.");
ABSL_FLAG(std::string, dir, "",
          "checkpoint: checkpoint name, a relative path inside the server's --checkpoint_root "
          "(e.g. run7/layer0).");
ABSL_FLAG(std::string, optimizer, "sgd", "apply-optimizer: sgd|adamw.");
ABSL_FLAG(double, lr, 1e-3, "apply-optimizer: learning rate.");
ABSL_FLAG(double, momentum, 0.0, "apply-optimizer: SGD momentum.");
ABSL_FLAG(double, weight_decay, 0.0, "apply-optimizer: weight decay (AdamW: decoupled).");
ABSL_FLAG(int64_t, expected_optimizer_step, -1,
          "apply-optimizer: apply only if the layer is at this optimizer step and its "
          "gradients were not dropped by a re-formation or restart since the last "
          "ZeroGradients or step (else ABORTED, nothing applied); -1: unconditional.");

namespace moe {
namespace client {
namespace cli {
namespace {

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

void PrintLayerLine(const v1::LayerInfo& layer) {
  std::fputs(DescribeLayer(layer).c_str(), stdout);
}

// Layer commands need --layer; returns the name or prints a usage error.
bool RequireLayer(absl::string_view command, std::string* layer, int* exit_code) {
  *layer = absl::GetFlag(FLAGS_layer);
  if (layer->empty()) {
    *exit_code = UsageError(command, "--layer is required");
    return false;
  }
  return true;
}

}  // namespace

int RunHealth(const Args& args) {
  if (!args.empty()) return UsageError("health", "takes no arguments");
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("health", client.status());
  const absl::Time give_up = absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_wait_ms));
  absl::StatusOr<ServingStatus> status;
  while (true) {
    CallOptions call;
    call.deadline = absl::Seconds(2);
    status = (*client)->Health(absl::GetFlag(FLAGS_service), call);
    if (status.ok() && *status == ServingStatus::kServing) break;
    if (absl::Now() >= give_up) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  if (!status.ok()) return ReportError("health", status.status());
  std::printf("%s\n", ServingStatusName(*status));
  return *status == ServingStatus::kServing ? 0 : 1;
}

int RunStatus(const Args& args) {
  if (!args.empty()) return UsageError("status", "takes no arguments");
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("status", client.status());
  auto status = (*client)->GetStatus();
  if (!status.ok()) return ReportError("status", status.status());
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(ProtoToJson(*status), /*indent=*/2);
    return 0;
  }
  std::printf("server: %s\nserving: %s  generation: %lld\nworkers: %d\n",
              (*client)->target().c_str(), status->serving() ? "yes" : "no",
              static_cast<long long>(status->generation()), status->world_size());
  if (!status->message().empty()) std::printf("message: %s\n", status->message().c_str());
  for (const v1::WorkerStatus& w : status->workers()) {
    std::printf("  rank %d  %s  %s  %s  pid %lld  memory %s (peak %s) of %s%s%s\n", w.rank(),
                w.address().empty() ? "(not joined)" : w.address().c_str(), w.device().c_str(),
                w.alive() ? "alive" : "DEAD", static_cast<long long>(w.pid()),
                Mib(w.memory_bytes()).c_str(), Mib(w.peak_memory_bytes()).c_str(),
                w.memory_capacity_bytes() > 0 ? Mib(w.memory_capacity_bytes()).c_str() : "?",
                w.error().empty() ? "" : "  error: ", w.error().c_str());
  }
  std::printf("layers: %d\n", status->layers_size());
  for (const v1::LayerInfo& layer : status->layers()) PrintLayerLine(layer);
  return 0;
}

int RunCreateLayer(const Args& args) {
  if (!args.empty()) return UsageError("create-layer", "takes no positional arguments");
  std::string name;
  int code = 0;
  if (!RequireLayer("create-layer", &name, &code)) return code;
  auto config = LayerConfigFromFlags();
  if (!config.ok()) return UsageError("create-layer", config.status().message());
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("create-layer", client.status());
  auto info = (*client)->CreateLayer(name, *config);
  if (!info.ok()) return ReportError("create-layer", info.status());
  PrintJson(ProtoToJson(*info), /*indent=*/2);
  return 0;
}

int RunDeleteLayer(const Args& args) {
  if (!args.empty()) return UsageError("delete-layer", "takes no positional arguments");
  std::string name;
  int code = 0;
  if (!RequireLayer("delete-layer", &name, &code)) return code;
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("delete-layer", client.status());
  absl::Status status = (*client)->DeleteLayer(name);
  if (!status.ok()) return ReportError("delete-layer", status);
  std::printf("deleted %s\n", name.c_str());
  return 0;
}

int RunListLayers(const Args& args) {
  if (!args.empty()) return UsageError("list-layers", "takes no arguments");
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("list-layers", client.status());
  auto layers = (*client)->ListLayers();
  if (!layers.ok()) return ReportError("list-layers", layers.status());
  std::printf("layers: %zu\n", layers->size());
  for (const v1::LayerInfo& layer : *layers) PrintLayerLine(layer);
  return 0;
}

int RunGetLayer(const Args& args) {
  if (!args.empty()) return UsageError("get-layer", "takes no positional arguments");
  std::string name;
  int code = 0;
  if (!RequireLayer("get-layer", &name, &code)) return code;
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("get-layer", client.status());
  auto info = (*client)->GetLayer(name);
  if (!info.ok()) return ReportError("get-layer", info.status());
  PrintJson(ProtoToJson(*info), /*indent=*/2);
  return 0;
}

int RunApplyOptimizer(const Args& args) {
  if (!args.empty()) return UsageError("apply-optimizer", "takes no positional arguments");
  std::string name;
  int code = 0;
  if (!RequireLayer("apply-optimizer", &name, &code)) return code;
  const std::string kind = absl::GetFlag(FLAGS_optimizer);
  if (kind != "sgd" && kind != "adamw") {
    return UsageError("apply-optimizer", "--optimizer is sgd or adamw");
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError("apply-optimizer", client.status());
  absl::Status status;
  v1::ApplyOptimizerResponse response;
  std::optional<int64_t> expected;
  if (absl::GetFlag(FLAGS_expected_optimizer_step) >= 0) {
    expected = absl::GetFlag(FLAGS_expected_optimizer_step);
  } else if (absl::GetFlag(FLAGS_expected_optimizer_step) != -1) {
    return UsageError("apply-optimizer", "--expected_optimizer_step is a step >= 0, or -1");
  }
  if (kind == "sgd") {
    v1::SgdOptimizer sgd;
    sgd.set_lr(absl::GetFlag(FLAGS_lr));
    sgd.set_momentum(absl::GetFlag(FLAGS_momentum));
    sgd.set_weight_decay(absl::GetFlag(FLAGS_weight_decay));
    status = (*client)->ApplySgd(name, sgd, {}, &response, expected);
  } else {
    v1::AdamWOptimizer adamw;
    adamw.set_lr(absl::GetFlag(FLAGS_lr));
    adamw.set_weight_decay(absl::GetFlag(FLAGS_weight_decay));
    status = (*client)->ApplyAdamW(name, adamw, {}, &response, expected);
  }
  if (!status.ok()) return ReportError("apply-optimizer", status);
  std::printf("applied %s (lr %g) to %s: optimizer step %lld (durable: %lld)\n", kind.c_str(),
              absl::GetFlag(FLAGS_lr), name.c_str(),
              static_cast<long long>(response.optimizer_step()),
              static_cast<long long>(response.durable_optimizer_step()));
  return 0;
}

int RunCheckpoint(const Args& args) {
  if (args.size() != 1 || (args[0] != "save" && args[0] != "load")) {
    return UsageError("checkpoint", "usage: moectl checkpoint save|load --layer=NAME --dir=DIR");
  }
  const std::string command = "checkpoint " + args[0];
  std::string name;
  int code = 0;
  if (!RequireLayer(command, &name, &code)) return code;
  const std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) return UsageError(command, "--dir is required");
  auto client = ConnectFromFlags();
  if (!client.ok()) return ReportError(command, client.status());
  if (args[0] == "save") {
    auto written = (*client)->SaveCheckpoint(name, dir);
    if (!written.ok()) return ReportError(command, written.status());
    std::printf("saved %s to %s\n", name.c_str(), written->c_str());
  } else {
    absl::Status status = (*client)->LoadCheckpoint(name, dir);
    if (!status.ok()) return ReportError(command, status);
    std::printf("loaded %s from %s\n", name.c_str(), dir.c_str());
  }
  return 0;
}

}  // namespace cli
}  // namespace client
}  // namespace moe
