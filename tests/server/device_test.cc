// The --device flag of moed and moe-worker: syntax, existence and the name GetStatus shows.
// Runs with and without GPUs: the expectations for "cuda" follow the visible device count.
#include "server/device.h"

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_optional.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(DeviceFlagTest, CpuIsAlwaysThere) {
  EXPECT_TRUE(CheckDeviceFlag("cpu").ok());
  EXPECT_EQ(DefaultEmbeddedWorkers("cpu"), 2);
  EXPECT_EQ(DeviceName("cpu", 3), "cpu");
}

TEST(DeviceFlagTest, UnknownSpellingsAreInvalidArguments) {
  for (const char* flag : {"", "gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", "cuda0", "tpu:0"}) {
    absl::Status status = CheckDeviceFlag(flag);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_NE(status.message().find("unsupported device"), std::string::npos) << flag;
  }
}

TEST(DeviceFlagTest, CudaFollowsTheVisibleDevices) {
  const int visible = VisibleCudaDevices();
  EXPECT_EQ(DefaultEmbeddedWorkers("cuda"), visible);
  const absl::Status any = CheckDeviceFlag("cuda");
  const absl::Status beyond = CheckDeviceFlag(absl::StrCat("cuda:", visible));
  EXPECT_EQ(beyond.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(beyond.message().find("visible"), std::string::npos) << beyond;
  if (visible == 0) {
    EXPECT_EQ(any.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(DeviceName("cuda", 1), "cuda");  // nothing to resolve it to
    return;
  }
  EXPECT_TRUE(any.ok()) << any;
  EXPECT_TRUE(CheckDeviceFlag("cuda:0").ok());
  // Ranks go round the visible GPUs; an explicit index or an unknown rank stays as given.
  for (int rank = 0; rank < 2 * visible + 1; ++rank) {
    EXPECT_EQ(DeviceName("cuda", rank), absl::StrCat("cuda:", rank % visible));
  }
  EXPECT_EQ(DeviceName("cuda", -1), "cuda");
  EXPECT_EQ(DeviceName("cuda:0", 5), "cuda:0");
}

}  // namespace
}  // namespace moe
