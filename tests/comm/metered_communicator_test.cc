// MeteredCommunicator: counts AllToAllV bytes to and from the other ranks and the calls' time,
// and passes every call through unchanged (engine/comm/metered_communicator.h).
#include "engine/comm/metered_communicator.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/time/clock.h"

namespace moe {
namespace {

// Rank 1 of 3; AllToAllV copies its own slice and takes ~5 ms; it fails when told to.
class FakeCommunicator : public Communicator {
 public:
  int rank() const override { return 1; }
  int size() const override { return 3; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  std::string name() const override { return "fake"; }
  absl::Status AllReduceSum(void*, size_t, DType) override { return absl::OkStatus(); }
  absl::Status AllGather(const void*, void*, size_t) override { return absl::OkStatus(); }
  absl::Status AllToAllV(const void*, absl::Span<const size_t>, void*,
                         absl::Span<const size_t>) override {
    ++calls;
    absl::SleepFor(absl::Milliseconds(5));
    return fail ? absl::UnavailableError("peer gone") : absl::OkStatus();
  }
  absl::Status Barrier() override { return absl::OkStatus(); }
  int calls = 0;
  bool fail = false;
};

TEST(MeteredCommunicatorTest, CountsBytesToAndFromOtherRanksAndTime) {
  auto fake = std::make_unique<FakeCommunicator>();
  FakeCommunicator* inner = fake.get();
  MeteredCommunicator comm(std::move(fake));
  EXPECT_EQ(comm.rank(), 1);
  EXPECT_EQ(comm.size(), 3);
  EXPECT_EQ(comm.name(), "fake");
  const std::vector<size_t> send = {10, 1000, 30};  // 1000 to itself: not traffic
  const std::vector<size_t> recv = {40, 1000, 60};
  std::vector<char> buffer(2000);
  ASSERT_TRUE(comm.AllToAllV(buffer.data(), send, buffer.data(), recv).ok());
  const CommTraffic first = comm.traffic();
  EXPECT_EQ(inner->calls, 1);
  EXPECT_EQ(first.all_to_all_calls, 1);
  EXPECT_EQ(first.all_to_all_bytes_sent, 40);
  EXPECT_EQ(first.all_to_all_bytes_received, 100);
  EXPECT_GE(first.all_to_all_time, absl::Milliseconds(5));

  inner->fail = true;  // a failed call still moved (some of) its bytes and took its time
  EXPECT_EQ(comm.AllToAllV(buffer.data(), send, buffer.data(), recv).code(),
            absl::StatusCode::kUnavailable);
  const CommTraffic step = comm.traffic() - first;
  EXPECT_EQ(step.all_to_all_calls, 1);
  EXPECT_EQ(step.all_to_all_bytes_sent, 40);
  EXPECT_EQ(step.all_to_all_bytes_received, 100);
  EXPECT_GE(step.all_to_all_time, absl::Milliseconds(5));
}

}  // namespace
}  // namespace moe
