#include "server/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moe {
namespace {

// Label values: escape backslash, quote and newline (Prometheus text format).
std::string Escape(const std::string& value) {
  std::string out;
  for (char ch : value) {
    if (ch == '\\' || ch == '"') out += '\\';
    if (ch == '\n') {
      out += "\\n";
      continue;
    }
    out += ch;
  }
  return out;
}

}  // namespace

void Metrics::CountRequest(const std::string& method, int grpc_code, double seconds) {
  absl::MutexLock lock(&mu_);
  ++requests_[{method, grpc_code}];
  Latency& latency = latency_[method];
  latency.sum += seconds;
  ++latency.count;
}

void Metrics::CountTokens(const std::string& layer, int64_t tokens,
                          const std::vector<int64_t>& tokens_per_expert) {
  absl::MutexLock lock(&mu_);
  tokens_[layer] += tokens;
  std::vector<int64_t>& experts = expert_tokens_[layer];
  if (experts.size() < tokens_per_expert.size()) experts.resize(tokens_per_expert.size(), 0);
  for (size_t e = 0; e < tokens_per_expert.size(); ++e) experts[e] += tokens_per_expert[e];
}

void Metrics::DropLayer(const std::string& layer) {
  absl::MutexLock lock(&mu_);
  tokens_.erase(layer);
  expert_tokens_.erase(layer);
}

std::string Metrics::Render() const {
  std::string out;
  {
    absl::MutexLock lock(&mu_);
    out += "# HELP moed_requests_total Public RPCs answered, by method and gRPC status code.\n";
    out += "# TYPE moed_requests_total counter\n";
    for (const auto& kv : requests_) {
      absl::StrAppend(&out, "moed_requests_total{method=\"", Escape(kv.first.first), "\",code=\"",
                      kv.first.second, "\"} ", kv.second, "\n");
    }
    out += "# HELP moed_request_seconds Latency of public RPCs.\n";
    out += "# TYPE moed_request_seconds summary\n";
    for (const auto& kv : latency_) {
      absl::StrAppend(&out, "moed_request_seconds_sum{method=\"", Escape(kv.first), "\"} ",
                      kv.second.sum, "\n", "moed_request_seconds_count{method=\"", Escape(kv.first),
                      "\"} ", kv.second.count, "\n");
    }
    out += "# HELP moed_tokens_total Tokens processed by Forward, by layer.\n";
    out += "# TYPE moed_tokens_total counter\n";
    for (const auto& kv : tokens_) {
      absl::StrAppend(&out, "moed_tokens_total{layer=\"", Escape(kv.first), "\"} ", kv.second,
                      "\n");
    }
    out += "# HELP moed_expert_tokens_total (token, slot) pairs routed to each expert.\n";
    out += "# TYPE moed_expert_tokens_total counter\n";
    for (const auto& kv : expert_tokens_) {
      for (size_t e = 0; e < kv.second.size(); ++e) {
        absl::StrAppend(&out, "moed_expert_tokens_total{layer=\"", Escape(kv.first), "\",expert=\"",
                        e, "\"} ", kv.second[e], "\n");
      }
    }
  }
  if (extra_) out += extra_();
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    int port, std::function<std::string()> render) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("metrics socket: ", strerror(errno)));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 16) != 0) {
    const std::string error = strerror(errno);
    close(fd);
    return absl::UnavailableError(absl::StrCat("metrics port ", port, ": ", error));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(fd, ntohs(addr.sin_port), std::move(render)));
}

MetricsHttpServer::MetricsHttpServer(int fd, int port, std::function<std::string()> render)
    : fd_(fd), port_(port), render_(std::move(render)) {
  thread_ = std::thread([this] { Serve(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  stopping_ = true;
  thread_.join();
  close(fd_);
}

void MetricsHttpServer::Serve() {
  while (!stopping_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    int client = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    // Read the request head (bounded; a slow client gets 1 s in all, not per read, and 1 s
    // per send below: one client must not hold the only serving thread).
    timeval send_timeout{1, 0};
    setsockopt(client, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    const absl::Time head_deadline = absl::Now() + absl::Seconds(1);
    char buffer[4096];
    std::string request;
    pollfd c{client, POLLIN, 0};
    int wait_ms;
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < 65536 &&
           (wait_ms = static_cast<int>(absl::ToInt64Milliseconds(head_deadline - absl::Now()))) >
               0 &&
           poll(&c, 1, wait_ms) > 0) {
      ssize_t n = read(client, buffer, sizeof(buffer));
      if (n <= 0) break;
      request.append(buffer, static_cast<size_t>(n));
    }
    std::string body, status = "200 OK";
    if (request.compare(0, 4, "GET ") == 0) {
      body = render_();
    } else {
      status = "405 Method Not Allowed";
      body = "only GET\n";
    }
    const std::string response =
        absl::StrCat("HTTP/1.0 ", status, "\r\nContent-Type: text/plain; version=0.0.4\r\n",
                     "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
    size_t sent = 0;
    while (sent < response.size()) {
      ssize_t n = send(client, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    close(client);
  }
}

}  // namespace moe
