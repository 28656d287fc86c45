// Reading moed's Prometheus endpoint in tests: one GET of /metrics, and one series' value.
//
//   const std::string scrape = ScrapeMetrics(port);
//   EXPECT_EQ(Sample(scrape, "moed_worker_deaths_total"), 1);
#ifndef MOED_TESTS_SERVER_METRICS_SCRAPE_H_
#define MOED_TESTS_SERVER_METRICS_SCRAPE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace moe {

// The HTTP answer (headers and body), or "" when nothing listens on the port.
inline std::string ScrapeMetrics(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  const std::string get = "GET /metrics HTTP/1.0\r\n\r\n";
  std::string reply;
  if (write(fd, get.data(), get.size()) == static_cast<ssize_t>(get.size())) {
    char buffer[4096];
    ssize_t n;
    while ((n = read(fd, buffer, sizeof(buffer))) > 0) reply.append(buffer, n);
  }
  close(fd);
  return reply;
}

// The value of one series in a scrape ("name{labels}"), 0 when absent.
inline double Sample(const std::string& scrape, const std::string& series) {
  const std::string key = "\n" + series + " ";
  const size_t at = scrape.find(key);
  if (at == std::string::npos) return 0.0;
  return std::strtod(scrape.c_str() + at + key.size(), nullptr);
}

}  // namespace moe

#endif  // MOED_TESTS_SERVER_METRICS_SCRAPE_H_
