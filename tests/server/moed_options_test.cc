// moed's options: flags read into MoedOptions, and the checks that refuse a bad start
// (server/moed_options.h). tests/server:embedded_test checks that moed exits 2 on them.
#include "server/moed_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"

ABSL_DECLARE_FLAG(int, workers);
ABSL_DECLARE_FLAG(int, expect_workers);
ABSL_DECLARE_FLAG(int64_t, heartbeat_ms);
ABSL_DECLARE_FLAG(int64_t, handler_threads);
ABSL_DECLARE_FLAG(int64_t, saved_step_ttl_s);
ABSL_DECLARE_FLAG(std::string, metrics_listen);

namespace moe {
namespace {

using ::testing::HasSubstr;

absl::Status Validate(const std::function<void(MoedOptions&)>& change) {
  MoedOptions options = MoedOptionsFromFlags();  // the defaults
  change(options);
  return ValidateMoedOptions(options);
}

void ExpectRefused(const std::function<void(MoedOptions&)>& change, const char* says) {
  absl::Status status = Validate(change);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << says;
  EXPECT_THAT(status.message(), HasSubstr(says));
}

TEST(MoedOptionsTest, DefaultsAreValidAndEmbedded) {
  absl::FlagSaver saver;
  MoedOptions options = MoedOptionsFromFlags();
  EXPECT_TRUE(ValidateMoedOptions(options).ok()) << ValidateMoedOptions(options);
  EXPECT_TRUE(options.embedded);
  EXPECT_EQ(options.world, 2);  // --device=cpu without --workers
  EXPECT_EQ(options.pool.world_size, 2);
  EXPECT_EQ(options.listen, "127.0.0.1");
  EXPECT_EQ(options.service.saved_step_ttl, absl::Seconds(600));
  // Below Kubernetes' default terminationGracePeriodSeconds (30).
  EXPECT_EQ(options.shutdown_grace, absl::Seconds(25));
}

TEST(MoedOptionsTest, FlagsReachTheirTypedFields) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_expect_workers, 3);
  absl::SetFlag(&FLAGS_heartbeat_ms, 250);
  absl::SetFlag(&FLAGS_handler_threads, int64_t{1} << 40);  // clamped to what an int holds
  absl::SetFlag(&FLAGS_saved_step_ttl_s, 0);
  MoedOptions options = MoedOptionsFromFlags();
  EXPECT_FALSE(options.embedded);
  EXPECT_EQ(options.world, 3);
  EXPECT_EQ(options.pool.heartbeat_interval, absl::Milliseconds(250));
  EXPECT_EQ(options.service.handler_threads, 1 << 16);
  EXPECT_EQ(options.service.saved_step_ttl, absl::ZeroDuration());
}

// Metrics are on by default, on loopback, best effort; a given address must be bound; a bare port
// means loopback (civetweb alone would bind every interface); "off" turns them off.
TEST(MoedOptionsTest, MetricsListenDefaultsToLoopbackBestEffort) {
  absl::FlagSaver saver;
  MoedOptions options = MoedOptionsFromFlags();
  EXPECT_EQ(options.metrics_listen, "127.0.0.1:9090");
  EXPECT_FALSE(options.metrics_listen_required);
  absl::SetFlag(&FLAGS_metrics_listen, "9464");
  options = MoedOptionsFromFlags();
  EXPECT_EQ(options.metrics_listen, "127.0.0.1:9464");
  EXPECT_TRUE(options.metrics_listen_required);
  absl::SetFlag(&FLAGS_metrics_listen, "0.0.0.0:9090");
  EXPECT_EQ(MoedOptionsFromFlags().metrics_listen, "0.0.0.0:9090");
  EXPECT_TRUE(MoedOptionsFromFlags().metrics_listen_required);
  absl::SetFlag(&FLAGS_metrics_listen, "off");
  EXPECT_EQ(MoedOptionsFromFlags().metrics_listen, "");
}

TEST(MoedOptionsTest, RefusesNoWorkers) {
  ExpectRefused([](MoedOptions& o) { o.world = 0; }, "--workers or --expect_workers");
}

TEST(MoedOptionsTest, RefusesAnUnknownDeviceInEmbeddedModeOnly) {
  ExpectRefused([](MoedOptions& o) { o.device = "tpu"; }, "tpu");
  EXPECT_TRUE(Validate([](MoedOptions& o) {
                o.device = "tpu";
                o.embedded = false;
                o.cluster_secret_file = "/run/secret";
              }).ok());
}

TEST(MoedOptionsTest, RefusesNonPositiveTimingAndSizeFlags) {
  ExpectRefused([](MoedOptions& o) { o.pool.heartbeat_interval = absl::ZeroDuration(); },
                "--heartbeat_ms must be > 0, got 0");
  ExpectRefused([](MoedOptions& o) { o.pool.collective_timeout = absl::Milliseconds(-1); },
                "--collective_timeout_ms must be > 0, got -1");
  ExpectRefused([](MoedOptions& o) { o.service.step_timeout = absl::ZeroDuration(); },
                "--step_timeout_ms");
  ExpectRefused([](MoedOptions& o) { o.service.dp_step_timeout = absl::ZeroDuration(); },
                "--dp_step_timeout_ms must be > 0");
  ExpectRefused([](MoedOptions& o) { o.service.overdue_call_limit = absl::ZeroDuration(); },
                "--overdue_call_limit_s");
  ExpectRefused([](MoedOptions& o) { o.service.handler_threads = 0; }, "--handler_threads");
  ExpectRefused([](MoedOptions& o) { o.rendezvous.max_keys = -5; }, "--rendezvous_max_keys");
  ExpectRefused([](MoedOptions& o) { o.service.stream_idle_timeout = absl::ZeroDuration(); },
                "--stream_idle_timeout_s");
}

TEST(MoedOptionsTest, ZeroMeansNeverForTheTtls) {
  EXPECT_TRUE(Validate([](MoedOptions& o) {
                o.service.saved_step_ttl = absl::ZeroDuration();
                o.service.shm_idle_timeout = absl::ZeroDuration();
              }).ok());
  ExpectRefused([](MoedOptions& o) { o.service.saved_step_ttl = absl::Seconds(-1); },
                "--saved_step_ttl_s must be >= 0");
  ExpectRefused([](MoedOptions& o) { o.service.shm_idle_timeout = absl::Seconds(-1); },
                "--shm_idle_timeout_s");
  EXPECT_TRUE(Validate([](MoedOptions& o) { o.shutdown_grace = absl::ZeroDuration(); }).ok());
  ExpectRefused([](MoedOptions& o) { o.shutdown_grace = absl::Seconds(-1); },
                "--shutdown_grace_s must be >= 0");
}

TEST(MoedOptionsTest, RefusesMessageAndInflightSizesThatDisagree) {
  ExpectRefused([](MoedOptions& o) { o.service.max_message_bytes = 1000; }, "--max_message_bytes");
  ExpectRefused([](MoedOptions& o) { o.service.max_message_bytes = int64_t{1} << 31; },
                "--max_message_bytes");
  ExpectRefused(
      [](MoedOptions& o) { o.service.max_inflight_bytes = o.service.max_message_bytes - 1; },
      "--max_inflight_bytes must be at least --max_message_bytes");
  ExpectRefused([](MoedOptions& o) { o.service.handler_threads_per_client = -1; },
                "--handler_threads_per_client");
}

TEST(MoedOptionsTest, WorkerMemoryBytesIsALimitDerivedOrOff) {
  ExpectRefused([](MoedOptions& o) { o.service.worker_memory_bytes = -2; },
                "--worker_memory_bytes");
  for (int64_t value : {int64_t{-1}, int64_t{0}, int64_t{1} << 30}) {
    EXPECT_TRUE(Validate([value](MoedOptions& o) { o.service.worker_memory_bytes = value; }).ok())
        << value;
  }
}

TEST(MoedOptionsTest, BeyondLoopbackNeedsATokensFile) {
  ExpectRefused([](MoedOptions& o) { o.listen = "0.0.0.0"; }, "--tokens_file");
  EXPECT_TRUE(Validate([](MoedOptions& o) {
                o.listen = "0.0.0.0";
                o.tokens_file = "/etc/moed/tokens";
              }).ok());
}

TEST(MoedOptionsTest, ExternalWorkersNeedAClusterSecretFile) {
  ExpectRefused(
      [](MoedOptions& o) {
        o.embedded = false;
        o.world = 2;
      },
      "--cluster_secret_file");
}

}  // namespace
}  // namespace moe
