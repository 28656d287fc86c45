// Metrics without a server: the in-flight gauge and a worker's all-to-all series, as a scrape
// renders them (server/metrics.h). tests/server:service_test checks them through moed.
#include "server/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>

namespace moe {
namespace {

using ::testing::HasSubstr;

TEST(MetricsTest, InflightRequestsCountCallsWhileTheyRun) {
  Metrics metrics;
  {
    const InflightRequest first(&metrics, "Forward");
    const InflightRequest second(&metrics, "Forward");
    const InflightRequest other(&metrics, "GetStatus");
    EXPECT_THAT(metrics.Render(), HasSubstr("moed_inflight_requests{method=\"Forward\"} 2\n"));
    EXPECT_THAT(metrics.Render(), HasSubstr("moed_inflight_requests{method=\"GetStatus\"} 1\n"));
  }
  EXPECT_THAT(metrics.Render(), HasSubstr("moed_inflight_requests{method=\"Forward\"} 0\n"));
  const InflightRequest without_metrics(nullptr, "Forward");  // a service without metrics
}

TEST(MetricsTest, WorkerAllToAllBytesAndTime) {
  Metrics metrics;
  v1::WorkerStepTiming timing;
  timing.set_all_to_all_bytes_sent(1000);
  timing.set_all_to_all_bytes_received(600);
  timing.set_all_to_all_ms(2.0);
  metrics.ObserveWorker(1, "Forward", 0.01, timing);
  metrics.ObserveWorker(1, "Forward", 0.01, timing);
  const std::string scrape = metrics.Render();
  EXPECT_THAT(
      scrape,
      HasSubstr("moed_worker_all_to_all_bytes_total{direction=\"sent\",rank=\"1\"} 2000\n"));
  EXPECT_THAT(
      scrape,
      HasSubstr("moed_worker_all_to_all_bytes_total{direction=\"received\",rank=\"1\"} 1200\n"));
  EXPECT_THAT(scrape,
              HasSubstr("moed_worker_all_to_all_seconds_count{call=\"Forward\",rank=\"1\"} 2\n"));
  EXPECT_THAT(scrape,
              HasSubstr("moed_worker_all_to_all_seconds_sum{call=\"Forward\",rank=\"1\"} 0.004\n"));
}

}  // namespace
}  // namespace moe
