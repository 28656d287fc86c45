// moe-worker's options: flags read into WorkerOptions, and the checks that refuse a bad start
// (server/worker_options.h).
#include "server/worker_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "server/engine_flags.h"

ABSL_DECLARE_FLAG(std::string, frontend);
ABSL_DECLARE_FLAG(int, rejoin_after_s);
ABSL_DECLARE_FLAG(int, cluster_secret_fd);
ABSL_DECLARE_FLAG(double, deferred_wgrad_fraction);
ABSL_DECLARE_FLAG(std::string, gloo_iface);
ABSL_DECLARE_FLAG(int, gemm_streams);
ABSL_DECLARE_FLAG(bool, cublaslt_tuned);

namespace moe {
namespace {

using ::testing::HasSubstr;

WorkerOptions Valid() {
  WorkerOptions o;
  o.frontend = "127.0.0.1:50053";
  o.cluster_secret_file = "/run/secrets/cluster_secret";
  return o;
}

TEST(WorkerOptionsTest, FlagsReachTheirTypedFields) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_frontend, "10.0.0.5:50053");
  absl::SetFlag(&FLAGS_rejoin_after_s, 0);
  absl::SetFlag(&FLAGS_cluster_secret_fd, 7);
  WorkerOptions o = WorkerOptionsFromFlags();
  EXPECT_EQ(o.frontend, "10.0.0.5:50053");
  EXPECT_EQ(o.rejoin_after, absl::ZeroDuration());
  EXPECT_EQ(o.orphan_timeout, absl::Seconds(60));
  EXPECT_EQ(o.cluster_secret_fd, 7);
  EXPECT_EQ(o.device, "cpu");
  EXPECT_TRUE(ValidateWorkerOptions(o).ok()) << ValidateWorkerOptions(o);
}

TEST(WorkerOptionsTest, AcceptsAFrontendAndOneSecret) {
  EXPECT_TRUE(ValidateWorkerOptions(Valid()).ok());
}

TEST(WorkerOptionsTest, RefusesAMissingFrontend) {
  WorkerOptions o = Valid();
  o.frontend.clear();
  absl::Status status = ValidateWorkerOptions(o);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--frontend"));
}

TEST(WorkerOptionsTest, RefusesAnUnknownDevice) {
  WorkerOptions o = Valid();
  o.device = "tpu";
  EXPECT_FALSE(ValidateWorkerOptions(o).ok());
}

TEST(WorkerOptionsTest, NeedsExactlyOneClusterSecret) {
  WorkerOptions none = Valid();
  none.cluster_secret_file.clear();
  EXPECT_THAT(ValidateWorkerOptions(none).message(), HasSubstr("--cluster_secret_file"));
  WorkerOptions both = Valid();
  both.cluster_secret_fd = 3;
  EXPECT_THAT(ValidateWorkerOptions(both).message(), HasSubstr("--cluster_secret_file"));
}

// The engine flags (server/engine_flags.h) reach the engine's option structs, a value out of
// range refuses the start naming the flag, and moed hands a child worker exactly the engine
// flags given a value other than the default.
TEST(WorkerOptionsTest, EngineFlagsReachTheEngineAndTheWorkersMoedStarts) {
  absl::FlagSaver saver;
  EXPECT_TRUE(EngineFlagsForChild().empty());
  absl::SetFlag(&FLAGS_deferred_wgrad_fraction, 0.5);
  absl::SetFlag(&FLAGS_gloo_iface, "eth0");
  absl::SetFlag(&FLAGS_gemm_streams, 8);
  absl::SetFlag(&FLAGS_cublaslt_tuned, false);
  WorkerOptions o = WorkerOptionsFromFlags();
  EXPECT_EQ(o.engine.layer.deferred_wgrad_fraction, 0.5);
  EXPECT_EQ(o.engine.gloo.iface, "eth0");
  EXPECT_EQ(o.engine.cuda.gemm_streams, 8);
  EXPECT_FALSE(o.engine.cuda.cublaslt_tuned);
  EXPECT_THAT(EngineFlagsForChild(),
              ::testing::UnorderedElementsAre("--deferred_wgrad_fraction=0.5", "--gloo_iface=eth0",
                                              "--gemm_streams=8", "--cublaslt_tuned=false"));

  WorkerOptions bad = Valid();
  bad.engine.layer.deferred_wgrad_fraction = -1;
  EXPECT_THAT(std::string(ValidateWorkerOptions(bad).message()),
              HasSubstr("--deferred_wgrad_fraction"));
  bad = Valid();
  bad.engine.cuda.gemm_streams = 0;
  EXPECT_EQ(ValidateWorkerOptions(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ValidateWorkerOptions(bad).message()), HasSubstr("--gemm_streams=0"));
}

}  // namespace
}  // namespace moe
