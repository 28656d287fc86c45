// ring_bench: the round trip of a small request/response between two processes on one host
// over a RingChannel (transport/ring_channel.h: shared-memory rings, futex doorbells) next to
// a gRPC unary call over loopback of the same size in the same run (issue 37 §2: the fixed
// cost of a step), and optionally the Python caller (client/python/moe_client/ring.py).
// Every server is a forked process answering with the request's bytes (gRPC: the echo
// service of grpc_loopback_bench, bench/grpc_echo.h, with moed's bulk transport settings).
//
//   ring_bench --bytes=256 --iters=20000 --spin_us=0,20 --grpc_transports=tcp,unix
//              --python=/usr/bin/python3 --python_path=client/python
//
// One JSON line per case: case ("ring", "grpc_unary", "ring_python"), transport, spin_us
// (the doorbell's adaptive spin limit), bytes, iters, p50_us, p99_us, mean_us.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "bench/grpc_echo.h"
#include "transport/bulk_transport.h"
#include "transport/ring_channel.h"
#include "transport/shm_object.h"

ABSL_FLAG(int64_t, bytes, 256, "bytes of the request and of the response");
ABSL_FLAG(int, iters, 20000, "timed round trips per case, after --warmup untimed ones");
ABSL_FLAG(int, warmup, 1000, "untimed round trips per case");
ABSL_FLAG(std::string, spin_us, "0,20", "doorbell spin limits to try (µs, comma-separated)");
ABSL_FLAG(std::string, grpc_transports, "tcp,unix",
          "gRPC cases: tcp (127.0.0.1), unix; empty: none");
ABSL_FLAG(std::string, python, "", "a python3 to run the Python caller with (empty: skip)");
ABSL_FLAG(std::string, python_path, "client/python", "the folder holding moe_client");

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  double p50_us, p99_us, mean_us;
};

Stats Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double u : us) sum += u;
  return {us[us.size() / 2], us[static_cast<size_t>(us.size() * 0.99)], sum / us.size()};
}

void Print(const char* name, const std::string& transport, int spin_us, int64_t bytes, int iters,
           const Stats& s) {
  std::printf(
      "{\"case\": \"%s\", \"transport\": \"%s\", \"spin_us\": %d, \"bytes\": %lld, \"iters\": %d, "
      "\"p50_us\": %.2f, \"p99_us\": %.2f, \"mean_us\": %.2f}\n",
      name, transport.c_str(), spin_us, static_cast<long long>(bytes), iters, s.p50_us, s.p99_us,
      s.mean_us);
  std::fflush(stdout);
}

template <typename F>
absl::StatusOr<Stats> Time(int warmup, int iters, F&& round_trip) {
  for (int i = 0; i < warmup; ++i) {
    if (absl::Status s = round_trip(); !s.ok()) return s;
  }
  std::vector<double> us;
  us.reserve(iters);
  for (int i = 0; i < iters; ++i) {
    const Clock::time_point start = Clock::now();
    if (absl::Status s = round_trip(); !s.ok()) return s;
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  return Summarize(std::move(us));
}

absl::StatusOr<std::string> Echo(absl::string_view request) { return std::string(request); }

// C++ caller here, C++ server in a forked child.
absl::StatusOr<Stats> RingCase(int spin_us, const std::string& data) {
  moe::RingChannelOptions options;
  options.max_spin = absl::Microseconds(spin_us);
  options.ring_bytes = 1 << 20;
  absl::StatusOr<moe::ShmObject> object = moe::ShmObject::CreateAnonymous(
      "ring-bench", moe::RingChannel::RegionBytes(options.ring_bytes));
  if (!object.ok()) return object.status();
  const std::string path = absl::StrCat("/proc/", getpid(), "/fd/", object->fd());
  absl::StatusOr<std::unique_ptr<moe::RingChannel>> caller =
      moe::RingChannel::Create(*std::move(object), moe::RingChannel::Role::kCaller, options);
  if (!caller.ok()) return caller.status();
  const pid_t server = fork();
  if (server == 0) {
    absl::StatusOr<moe::ShmObject> mine = moe::ShmObject::OpenPath(path);
    if (!mine.ok()) _exit(2);
    absl::StatusOr<std::unique_ptr<moe::RingChannel>> channel =
        moe::RingChannel::Attach(*std::move(mine), moe::RingChannel::Role::kServer, options);
    if (!channel.ok()) _exit(2);
    _exit((*channel)->Serve(Echo).ok() ? 0 : 1);
  }
  absl::StatusOr<Stats> stats =
      Time(absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_iters), [&]() -> absl::Status {
        absl::StatusOr<std::string> r = (*caller)->Call(data, absl::Now() + absl::Seconds(10));
        if (!r.ok()) return r.status();
        if (r->size() != data.size()) {
          return absl::InternalError("echo of the wrong size");
        }
        return absl::OkStatus();
      });
  caller->reset();  // closes: the server exits
  int status = 0;
  waitpid(server, &status, 0);
  return stats;
}

// A gRPC echo server in a forked child. All of them are started before this process uses
// gRPC itself (gRPC does not survive a fork of a process that runs it).
struct GrpcServer {
  pid_t pid = -1;
  std::string transport;
  std::string target;
  std::string socket_path;
};

absl::StatusOr<GrpcServer> StartGrpcServer(const std::string& transport) {
  GrpcServer server;
  server.transport = transport;
  server.socket_path =
      absl::StrCat(std::getenv("TMPDIR") != nullptr ? std::getenv("TMPDIR") : "/tmp",
                   "/ring_bench.", getpid(), ".", transport, ".sock");
  int ready[2];
  if (pipe(ready) != 0) return absl::InternalError("pipe");
  server.pid = fork();
  if (server.pid == 0) {
    close(ready[0]);
    moe::bench::EchoService service;
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(transport == "unix" ? "unix:" + server.socket_path : "127.0.0.1:0",
                             grpc::InsecureServerCredentials(),
                             transport == "unix" ? nullptr : &port);
    builder.RegisterCallbackGenericService(&service);
    moe::SetBulkTransportArgs(&builder);
    std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
    if (grpc_server == nullptr) _exit(2);
    if (write(ready[1], &port, sizeof(port)) != sizeof(port)) _exit(2);
    pause();  // killed by the parent
    _exit(0);
  }
  close(ready[1]);
  int port = 0;
  const bool started = read(ready[0], &port, sizeof(port)) == sizeof(port);
  close(ready[0]);
  if (!started) return absl::InternalError("the gRPC echo server did not start");
  server.target =
      transport == "unix" ? "unix:" + server.socket_path : absl::StrCat("127.0.0.1:", port);
  return server;
}

void StopGrpcServer(const GrpcServer& server) {
  kill(server.pid, SIGKILL);
  int status = 0;
  waitpid(server.pid, &status, 0);
  unlink(server.socket_path.c_str());
}

// Unary calls from here to a forked echo server.
absl::StatusOr<Stats> GrpcCase(const GrpcServer& server, const std::string& data) {
  grpc::ChannelArguments args;
  moe::SetBulkTransportArgs(&args);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(server.target, grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  grpc::Slice slice(const_cast<char*>(data.data()), data.size(), grpc::Slice::STATIC_SLICE);
  return Time(absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_iters), [&]() -> absl::Status {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::ByteBuffer request(&slice, 1), answer;
    grpc::Status status;
    absl::Notification done;
    stub.UnaryCall(&context, moe::bench::kEchoMethod, grpc::StubOptions(), &request, &answer,
                   [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    done.WaitForNotification();
    if (!status.ok()) return absl::UnavailableError(status.error_message());
    if (answer.Length() != data.size()) return absl::InternalError("echo of the wrong size");
    return absl::OkStatus();
  });
}

// The Python caller (a child running moe_client.ring's benchmark), the C++ server here.
absl::Status PythonCase(const std::string& python, int spin_us) {
  moe::RingChannelOptions options;
  options.max_spin = absl::Microseconds(spin_us);  // both sides spin alike
  absl::StatusOr<moe::ShmObject> object = moe::ShmObject::CreateAnonymous(
      "ring-bench-py", moe::RingChannel::RegionBytes(options.ring_bytes));
  if (!object.ok()) return object.status();
  const std::string path = absl::StrCat("/proc/", getpid(), "/fd/", object->fd());
  absl::StatusOr<std::unique_ptr<moe::RingChannel>> server =
      moe::RingChannel::Create(*std::move(object), moe::RingChannel::Role::kServer, options);
  if (!server.ok()) return server.status();
  const std::string bytes = absl::StrCat("--bytes=", absl::GetFlag(FLAGS_bytes));
  const std::string iters = absl::StrCat("--iters=", absl::GetFlag(FLAGS_iters));
  const std::string warmup = absl::StrCat("--warmup=", absl::GetFlag(FLAGS_warmup));
  const std::string spin = absl::StrCat("--spin_us=", spin_us);
  const std::string pythonpath = absl::GetFlag(FLAGS_python_path);
  const pid_t caller = fork();
  if (caller == 0) {
    setenv("PYTHONPATH", pythonpath.c_str(), 1);
    execl(python.c_str(), python.c_str(), "-m", "moe_client.ring", "--path", path.c_str(),
          bytes.c_str(), iters.c_str(), warmup.c_str(), spin.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const absl::Status served = (*server)->Serve(Echo);  // until the caller closes or exits
  int status = 0;
  waitpid(caller, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat("the Python caller failed (status ", status, ")"));
  }
  return served;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  if (bytes < 0 || bytes > (1 << 19) || absl::GetFlag(FLAGS_iters) < 1 ||
      absl::GetFlag(FLAGS_warmup) < 0) {
    std::fprintf(stderr, "--bytes must be in [0, 512 KiB], --iters positive\n");
    return 2;
  }
  std::string data(static_cast<size_t>(bytes), '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 13 + 1);
  const int iters = absl::GetFlag(FLAGS_iters);
  std::vector<GrpcServer> grpc_servers;
  struct StopAll {
    std::vector<GrpcServer>& servers;
    ~StopAll() {
      for (const GrpcServer& server : servers) StopGrpcServer(server);
    }
  } stop_all{grpc_servers};  // also on the early returns
  for (absl::string_view t :
       absl::StrSplit(absl::GetFlag(FLAGS_grpc_transports), ',', absl::SkipEmpty())) {
    const std::string transport(t);
    if (transport != "tcp" && transport != "unix") {
      std::fprintf(stderr, "--grpc_transports: \"%s\" is not tcp or unix\n", transport.c_str());
      return 2;
    }
    absl::StatusOr<GrpcServer> server = StartGrpcServer(transport);
    if (!server.ok()) {
      std::fprintf(stderr, "grpc: %s\n", server.status().ToString().c_str());
      return 1;
    }
    grpc_servers.push_back(*std::move(server));
  }
  std::vector<int> spins;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_spin_us), ',', absl::SkipEmpty())) {
    int spin = 0;
    if (!absl::SimpleAtoi(s, &spin) || spin < 0) {
      std::fprintf(stderr, "--spin_us: \"%s\" is not a number of µs\n", std::string(s).c_str());
      return 2;
    }
    spins.push_back(spin);
  }
  for (const int spin : spins) {
    absl::StatusOr<Stats> stats = RingCase(spin, data);
    if (!stats.ok()) {
      std::fprintf(stderr, "ring: %s\n", stats.status().ToString().c_str());
      return 1;
    }
    Print("ring", "shm", spin, bytes, iters, *stats);
  }
  for (const int spin : spins) {
    if (absl::GetFlag(FLAGS_python).empty()) break;
    if (absl::Status s = PythonCase(absl::GetFlag(FLAGS_python), spin); !s.ok()) {
      std::fprintf(stderr, "ring_python: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  int rc = 0;
  for (const GrpcServer& server : grpc_servers) {
    absl::StatusOr<Stats> stats = GrpcCase(server, data);
    if (stats.ok()) {
      Print("grpc_unary", server.transport, -1, bytes, iters, *stats);
    } else {
      std::fprintf(stderr, "grpc %s: %s\n", server.transport.c_str(),
                   stats.status().ToString().c_str());
      rc = 1;
    }
  }
  return rc;
}
