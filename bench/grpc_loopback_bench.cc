// grpc_loopback_bench: how fast gRPC itself moves large messages over one loopback TCP
// connection, and whether splitting a message over several streams or channels helps
// (issue 12 §2; docs/DECISIONS.md). An in-process server echoes each request back (the
// answer shares the request's slices: no copy on the server); the client sends a buffer that
// borrows its bytes (as moed and the client do, proto/tensor_wire.h) and times round trips.
// The connections get moed's bulk transport settings (transport/bulk_transport.h; unset them
// with MOED_BULK_TRANSPORT=0).
//
//   grpc_loopback_bench --bytes=67108864 --iters=5 --parts=1,2,4
//
// Prints one JSON line per (mode, parts): mode "streams" = the parts as concurrent calls on
// one channel (one TCP connection), "channels" = one channel (connection) per part. gb_per_s
// counts both directions: 2 * bytes / median round trip.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/grpc_echo.h"
#include "transport/bulk_transport.h"

ABSL_FLAG(int64_t, bytes, int64_t{64} << 20, "bytes of one message (split over the parts)");
ABSL_FLAG(int, iters, 5, "timed round trips per (mode, parts), after one warm-up");
ABSL_FLAG(std::string, parts, "1,2,4", "comma-separated numbers of parts to try");
ABSL_FLAG(std::string, transport, "tcp",
          "tcp (127.0.0.1) or unix (a Unix domain socket in $TMPDIR or /tmp)");

namespace {

using moe::bench::EchoService;
using moe::bench::kEchoMethod;

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  moe::SetBulkTransportArgs(&args);
  args.SetInt("moed.bench.channel_index", index);  // a distinct arg: a connection of its own
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// One round trip of `data` split into channels.size() parts sent concurrently, part i on
// channels[i]; returns the wall time in seconds, or a negative number on failure.
double RoundTrip(const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                 const std::string& data) {
  const size_t parts = channels.size();
  const size_t piece = (data.size() + parts - 1) / parts;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<grpc::ByteBuffer> requests(parts), answers(parts);
  std::vector<grpc::Status> statuses(parts);
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (size_t i = 0; i < parts; ++i) {
    const size_t begin = std::min(data.size(), i * piece);
    const size_t size = std::min(piece, data.size() - begin);
    // Borrowed, not copied (data outlives the calls; nothing to release).
    grpc::Slice slice(const_cast<char*>(data.data() + begin), size, grpc::Slice::STATIC_SLICE);
    requests[i] = grpc::ByteBuffer(&slice, 1);
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    stubs.push_back(std::make_unique<grpc::GenericStub>(channels[i]));
  }
  absl::BlockingCounter done(static_cast<int>(parts));
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < parts; ++i) {
    stubs[i]->UnaryCall(contexts[i].get(), kEchoMethod, grpc::StubOptions(), &requests[i],
                        &answers[i], [&, i](grpc::Status s) {
                          statuses[i] = std::move(s);
                          done.DecrementCount();
                        });
  }
  done.Wait();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (size_t i = 0; i < parts; ++i) {
    if (!statuses[i].ok() || answers[i].Length() != requests[i].Length()) {
      std::fprintf(stderr, "call %zu failed: %s\n", i, statuses[i].error_message().c_str());
      return -1.0;
    }
  }
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int iters = absl::GetFlag(FLAGS_iters);
  std::vector<int> part_counts;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_parts), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(p, &n) || n < 1) {
      std::fprintf(stderr, "--parts: \"%s\" is not a positive number\n", std::string(p).c_str());
      return 2;
    }
    part_counts.push_back(n);
  }
  if (bytes < 1 || iters < 1) {
    std::fprintf(stderr, "--bytes and --iters must be positive\n");
    return 2;
  }

  EchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "tcp" && transport != "unix") {
    std::fprintf(stderr, "--transport: \"%s\" is not tcp or unix\n", transport.c_str());
    return 2;
  }
  const char* tmp = std::getenv("TMPDIR");
  const std::string socket_path = std::string(tmp != nullptr ? tmp : "/tmp") +
                                  "/grpc_loopback_bench." + std::to_string(getpid()) + ".sock";
  const std::string address =
      transport == "unix" ? "unix:" + socket_path : std::string("127.0.0.1:0");
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(),
                           transport == "unix" ? nullptr : &port);
  builder.RegisterCallbackGenericService(&service);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  moe::SetBulkTransportArgs(&builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || (transport == "tcp" && port == 0)) {
    std::fprintf(stderr, "cannot start the echo server\n");
    return 1;
  }
  const std::string target = transport == "unix" ? address : "127.0.0.1:" + std::to_string(port);
  std::string data(static_cast<size_t>(bytes), '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 13 + 1);

  for (const char* mode : {"streams", "channels"}) {
    for (int parts : part_counts) {
      std::vector<std::shared_ptr<grpc::Channel>> channels;
      for (int i = 0; i < parts; ++i) {
        channels.push_back(std::string(mode) == "channels" || channels.empty()
                               ? MakeChannel(target, i)
                               : channels.front());
      }
      if (RoundTrip(channels, data) < 0) return 1;  // warm-up: connects, grows windows
      std::vector<double> seconds;
      for (int i = 0; i < iters; ++i) {
        const double s = RoundTrip(channels, data);
        if (s < 0) return 1;
        seconds.push_back(s);
      }
      std::sort(seconds.begin(), seconds.end());
      const double median = seconds[seconds.size() / 2];
      std::printf(
          "{\"transport\": \"%s\", \"mode\": \"%s\", \"parts\": %d, \"bytes\": %lld, \"iters\": "
          "%d, "
          "\"round_trip_ms_p50\": %.2f, \"round_trip_ms_min\": %.2f, \"gb_per_s\": %.3f}\n",
          transport.c_str(), mode, parts, static_cast<long long>(bytes), iters, median * 1e3,
          seconds.front() * 1e3, 2.0 * static_cast<double>(bytes) / median / 1e9);
      std::fflush(stdout);
    }
  }
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  return 0;
}
