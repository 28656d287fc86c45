// Internals of moectl (client/moectl_main.cc): the flags every subcommand shares and one
// entry point per subcommand. Each Run* takes the positional arguments after the subcommand
// name and returns the process exit code: 0 success, 1 failure (RPC error, FAIL verdict),
// 2 usage error. Errors go to stderr as "moectl <command>: <CODE>: <message>", CODE being the
// gRPC status name (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, ...), so scripts can grep it.
#ifndef MOED_CLIENT_MOECTL_H_
#define MOED_CLIENT_MOECTL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/moe_client.h"

ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(int64_t, deadline_ms);
ABSL_DECLARE_FLAG(std::string, layer);
ABSL_DECLARE_FLAG(int64_t, tokens);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(uint64_t, input_seed);
ABSL_DECLARE_FLAG(bool, json);

namespace moe {
namespace client {
namespace cli {

using Args = std::vector<std::string>;

// A client for --server with --deadline_ms as its default deadline; step_channel overrides
// --step_channel when set.
absl::StatusOr<std::unique_ptr<MoeClient>> ConnectFromFlags(
    std::optional<bool> step_channel = std::nullopt);
// Prints "moectl <command>: CODE: message" to stderr; returns 1.
int ReportError(absl::string_view command, const absl::Status& status);
// Prints "moectl <command>: <message>" and a hint to stderr; returns 2.
int UsageError(absl::string_view command, absl::string_view message);
// A failure on this machine (reading --input, writing --output): prints "moectl <command>:
// <what>: <message>" without a gRPC code, so it cannot pass for the server's answer; returns 1.
int LocalError(absl::string_view command, absl::string_view what, const absl::Status& status);
// --server (or $MOED_SERVER) with moed's default port 50051 added when it names only a host
// ("node1", "10.0.0.5", "[::1]", "::1"); targets with a port or a gRPC scheme stay as given.
std::string TargetWithDefaultPort(const std::string& target);
// --dtype as a DType (FP32 or BF16).
absl::StatusOr<DType> InputDTypeFromFlag();
// --tokens for a random [tokens, hidden] input of `dtype`: INVALID_ARGUMENT (a usage error)
// when negative, or when the input and output would not fit in this host's memory (larger
// than one message is fine: streamed); checked before anything that large is allocated.
absl::Status CheckTokensFlag(int64_t hidden, DType dtype);
// A layer name for commands that create a temporary layer: --layer, or "<prefix>-<pid>".
std::string LayerNameOr(absl::string_view prefix);

int RunHealth(const Args& args);
int RunStatus(const Args& args);
int RunCreateLayer(const Args& args);
int RunDeleteLayer(const Args& args);
int RunListLayers(const Args& args);
int RunGetLayer(const Args& args);
int RunForward(const Args& args);
int RunBackward(const Args& args);
int RunApplyOptimizer(const Args& args);
int RunCheckpoint(const Args& args);
int RunSmoke(const Args& args);
int RunBench(const Args& args);
// bench's helpers (client/moectl_bench.cc). The nearest-rank percentile p (0-100) of values
// (0 when empty).
double Percentile(std::vector<double> values, double p);
// The layer a bench runs on: `name` as it is (GetLayer), or, when `temporary`, created from the
// layer flags. *usage_error: the layer flags, or --tokens for its hidden size, are at fault
// (the status says why); otherwise a failure is the server's.
absl::StatusOr<v1::LayerInfo> OpenBenchLayer(MoeClient& c, const std::string& name,
                                             bool temporary, DType dtype, bool* usage_error);
// bench --callers=N (client/moectl_bench_callers.cc): N concurrent callers, unbatched then
// batched.
int RunBenchCallers(int callers);

}  // namespace cli
}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_MOECTL_H_
