// moectl: the command-line client of moed. See kUsage below (or `moectl --help`).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cli/usage.h"
#include "client/moectl.h"

ABSL_FLAG(std::string, server, "",
          "moed address host:port (default: $MOED_SERVER, else localhost:50051).");
ABSL_FLAG(int64_t, deadline_ms, 60000, "Deadline of each RPC, milliseconds.");
ABSL_FLAG(std::string, token, "",
          "Bearer token for moed --tokens_file (default: --token_file, else $MOED_TOKEN). "
          "Prefer --token_file or $MOED_TOKEN: a flag shows in the process list.");
ABSL_FLAG(std::string, token_file, "", "File holding the bearer token (first line).");
ABSL_FLAG(std::string, tls_ca_file, "",
          "Connect over TLS, trusting this PEM CA (default: $MOED_TLS_CA_FILE; empty: "
          "plaintext).");
ABSL_FLAG(std::string, tls_cert_file, "", "Client certificate (PEM) for mutual TLS.");
ABSL_FLAG(std::string, tls_key_file, "", "Client private key (PEM) for mutual TLS.");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name to check moed's certificate against (default: the host of --server).");
ABSL_FLAG(std::string, layer, "",
          "Layer name. smoke and bench create (and delete) a temporary layer when empty.");
ABSL_FLAG(int64_t, tokens, 32, "T: tokens of a random input (forward, backward, smoke, bench).");
ABSL_FLAG(std::string, dtype, "fp32", "Datatype of random inputs: fp32|bf16.");
ABSL_FLAG(uint64_t, input_seed, 1, "Seed of random inputs (x, d_out).");
ABSL_FLAG(int32_t, lanes, 0,
          "Forward / Backward tensors of --lane_min_bytes or more go, and come back, in row "
          "ranges over this many connections at once (moed's StageTensor / FetchStaged; a "
          "moed with --shm_relay=false gets them in the step); 1: one connection; 0: this "
          "host's cores, at most 16 (1 with 2 cores or fewer)");
ABSL_FLAG(int64_t, lane_min_bytes, int64_t{4} << 20,
          "smallest tensor (bytes) sent over --lanes connections");
ABSL_FLAG(bool, step_channel, true,
          "steps (forward, backward, bench, ...) go through a step channel (a shared-memory "
          "ring instead of a gRPC call each) when --server is on this host and moed runs with "
          "--allow_client_shm; else, or when it fails, over gRPC (one line on stderr). "
          "--nostep_channel: always gRPC");
ABSL_FLAG(int64_t, ring_spin_us, 0,
          "with the step channel: spin up to this many microseconds waiting for moed's answer "
          "before sleeping on the futex (adaptive; a core busy while it spins; moed's own "
          "--ring_spin_us is its side); 0: never spin");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{256} << 20,
          "Largest message sent, as moed's flag of the same name (keep it at or below moed's); "
          "larger x / d_out go in pieces through ForwardStream / BackwardStream.");

namespace {

constexpr char kUsage[] = R"(the command-line client of moed (moe.v1.MoeService).

usage: moectl <command> [flags]

commands:
  health          grpc.health.v1 check; exit 0 iff SERVING.
                    --wait_ms=N keeps asking until SERVING or N ms have passed.
                    --service=NAME checks one name: "liveness" (the process runs), or
                    "moe.v1.MoeService"; works against a moe-worker's port too.
  status          workers (rank, address, device, alive, memory), layers, serving state.
                    --json prints the GetStatusResponse as JSON.
  create-layer    --layer=NAME and the layer flags below; prints the LayerInfo.
  delete-layer    --layer=NAME
  list-layers     one line per layer.
  get-layer       --layer=NAME; prints the LayerInfo as JSON.
  forward         --layer=NAME [--input=x.npy | --tokens=T --dtype=fp32|bf16 --input_seed=S]
                    [--output=out.npy] [--keep_for_backward]; prints a JSON summary with
                    aux_loss, z_loss, tokens_per_expert and step_id.
  backward        --layer=NAME --step_id=ID [--d_out=d.npy | --tokens=T (random d_out)]
                    [--d_aux=1 --d_z_loss=1] [--output=d_x.npy]
  apply-optimizer --layer=NAME [--optimizer=sgd|adamw --lr=1e-3 --momentum=0
                    --weight_decay=0 --expected_optimizer_step=S]: one step from the accumulated
                    gradients, which it zeroes; prints the layer's optimizer step and its durable
                    step (moed --state_dir). With --expected_optimizer_step only if the layer is
                    at step S with its gradients intact (else ABORTED, nothing applied).
  checkpoint      save|load --layer=NAME --dir=DIR (a directory on the server's disk).
  smoke           creates a layer from the layer flags, runs a forward and a backward through
                    the service and the same step in-process on the local CPU engine, compares
                    out, aux, z-loss, d_x, the initial weights and every gradient; prints
                    PASS/FAIL with the max relative errors (max|a-b| / max|ref|).
                    --rtol (default 1e-4 fp32, 3e-2 bf16) --keep_layer --json
  bench           steps/s and latency percentiles (p50/p90/p99) of forward and
                    forward+backward: --steps=N --warmup=W --tokens=T; progress on stderr,
                    JSON on stdout. Uses --layer if given, else a temporary layer.

common flags: --server=HOST:PORT --deadline_ms=MS --token_file=PATH (or $MOED_TOKEN)
  --tls_ca_file=PEM [--tls_cert_file=PEM --tls_key_file=PEM] [--tls_server_name=NAME]
layer flags (create-layer, smoke, bench): --hidden --ffn --experts --top_k
  --score_function=softmax|sigmoid --pre_softmax --num_groups --group_topk --scaling_factor
  --expert_bias --aux_loss_coeff --z_loss_coeff --capacity_factor --align_size
  --activation=silu|gelu|relu|linear --gated --use_bias --compute_dtype=fp32|bf16|fp8 --seed

Bad requests come back with their gRPC code on stderr, e.g.
  moectl forward: INVALID_ARGUMENT: x: shape [32, 16] does not match ...
exit status: 0 ok, 1 error or FAIL, 2 usage error.
.npy files: outputs are written as float32 ('<f4'); NumPy has no bfloat16, so BF16 results are
widened to float32 (exactly). Inputs may be float32 or float64 and are converted to --dtype
(fp32 by default, bf16 rounds to nearest even).
)";

}  // namespace

namespace moe {
namespace client {
namespace cli {

absl::StatusOr<std::unique_ptr<MoeClient>> ConnectFromFlags(std::optional<bool> step_channel) {
  std::string target = absl::GetFlag(FLAGS_server);
  if (target.empty()) {
    const char* env = std::getenv("MOED_SERVER");
    target = env != nullptr && *env != '\0' ? env : "localhost:50051";
  }
  target = TargetWithDefaultPort(target);
  ClientOptions options;
  options.default_deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  options.token = absl::GetFlag(FLAGS_token);
  if (options.token.empty() && !absl::GetFlag(FLAGS_token_file).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_token_file));
    if (!in) {
      return absl::InvalidArgumentError(
          absl::StrCat("--token_file: cannot read ", absl::GetFlag(FLAGS_token_file)));
    }
    std::getline(in, options.token);
    options.token = std::string(absl::StripAsciiWhitespace(options.token));
  }
  if (options.token.empty()) {
    const char* env = std::getenv("MOED_TOKEN");
    if (env != nullptr) options.token = env;
  }
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  if (options.tls_ca_file.empty()) {
    const char* env = std::getenv("MOED_TLS_CA_FILE");
    if (env != nullptr) options.tls_ca_file = env;
  }
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.max_message_bytes = static_cast<int>(
      std::clamp<int64_t>(absl::GetFlag(FLAGS_max_message_bytes), int64_t{1} << 16, INT32_MAX));
  options.lanes = std::clamp(absl::GetFlag(FLAGS_lanes), 0, 64);
  options.lane_min_bytes = absl::GetFlag(FLAGS_lane_min_bytes);
  options.step_channel = step_channel.value_or(absl::GetFlag(FLAGS_step_channel));
  options.step_channel_spin =
      absl::Microseconds(std::clamp<int64_t>(absl::GetFlag(FLAGS_ring_spin_us), 0, 10000));
  return MoeClient::Connect(target, options);
}

int ReportError(absl::string_view command, const absl::Status& status) {
  std::fprintf(stderr, "moectl %s: %s: %s\n", std::string(command).c_str(),
               absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return 1;
}

int LocalError(absl::string_view command, absl::string_view what, const absl::Status& status) {
  std::fprintf(stderr, "moectl %s: %s: %s\n", std::string(command).c_str(),
               std::string(what).c_str(), std::string(status.message()).c_str());
  return 1;
}

std::string TargetWithDefaultPort(const std::string& target) {
  constexpr absl::string_view kPort = ":50051";  // moed's default --port
  if (target.empty() || absl::StrContains(target, "://")) return target;
  if (target[0] == '[') {
    return absl::StrContains(target, "]:") ? target : absl::StrCat(target, kPort);
  }
  const size_t colons = std::count(target.begin(), target.end(), ':');
  if (colons == 0) return absl::StrCat(target, kPort);  // "host"
  if (colons == 1) return target;  // "host:port", or a gRPC scheme ("unix:path", "dns:host")
  // Several colons: a bare IPv6 address, unless a scheme ("ipv6:[::1]:1", "dns:host:1").
  const bool scheme = absl::StartsWith(target, "ipv4:") || absl::StartsWith(target, "ipv6:") ||
                      absl::StartsWith(target, "dns:") || absl::StartsWith(target, "unix");
  return scheme ? target : absl::StrCat("[", target, "]", kPort);
}

int UsageError(absl::string_view command, absl::string_view message) {
  std::fprintf(stderr, "moectl %s: %s\n(see moectl --help)\n", std::string(command).c_str(),
               std::string(message).c_str());
  return 2;
}

absl::StatusOr<DType> InputDTypeFromFlag() {
  const std::string name = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_dtype));
  if (name == "FP32") return DType::kFloat32;
  if (name == "BF16") return DType::kBFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype: '", absl::GetFlag(FLAGS_dtype), "' is not fp32 or bf16"));
}

absl::Status CheckTokensFlag(int64_t hidden, DType dtype) {
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  if (tokens < 0) return absl::InvalidArgumentError("--tokens must be >= 0");
  // Inputs larger than one message are streamed in pieces (MoeClient); what bounds a step
  // is this host's memory, which must hold the input and the output.
  const int64_t row_bytes = std::max<int64_t>(hidden, 1) * static_cast<int64_t>(DTypeSize(dtype));
  const int64_t memory = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  if (memory > 0 && tokens > memory / 2 / row_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens=", tokens, ": a [", tokens, ", ", hidden, "] ", DTypeName(dtype),
                     " input and its output need more than this host's memory (", memory,
                     " bytes); at most ", memory / 2 / row_bytes, " tokens per step"));
  }
  return absl::OkStatus();
}

std::string LayerNameOr(absl::string_view prefix) {
  const std::string layer = absl::GetFlag(FLAGS_layer);
  return layer.empty() ? absl::StrCat(prefix, "-", getpid()) : layer;
}

}  // namespace cli
}  // namespace client
}  // namespace moe

int main(int argc, char** argv) {
  using moe::client::cli::Args;
  // --help lists the flags of every moectl source file, not only of this one.
  std::vector<char*> positional =
      moe::cli::ParseCommandLine(argc, argv, {"moectl", kUsage, {"client/"}});

  const std::map<std::string, std::function<int(const Args&)>> commands = {
      {"health", moe::client::cli::RunHealth},
      {"status", moe::client::cli::RunStatus},
      {"create-layer", moe::client::cli::RunCreateLayer},
      {"delete-layer", moe::client::cli::RunDeleteLayer},
      {"list-layers", moe::client::cli::RunListLayers},
      {"get-layer", moe::client::cli::RunGetLayer},
      {"forward", moe::client::cli::RunForward},
      {"backward", moe::client::cli::RunBackward},
      {"apply-optimizer", moe::client::cli::RunApplyOptimizer},
      {"checkpoint", moe::client::cli::RunCheckpoint},
      {"smoke", moe::client::cli::RunSmoke},
      {"bench", moe::client::cli::RunBench},
  };
  if (positional.size() < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string command = positional[1];
  if (command == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  auto it = commands.find(command);
  if (it == commands.end()) {
    return moe::client::cli::UsageError(command, "unknown command");
  }
  Args args(positional.begin() + 2, positional.end());
  return it->second(args);
}
