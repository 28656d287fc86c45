#include "engine/comm/local_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

class LocalCommunicator : public Communicator {
 public:
  explicit LocalCommunicator(MemorySpace space) : space_(space) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  MemorySpace memory_space() const override { return space_; }
  std::string name() const override { return "local"; }

  absl::Status AllReduceSum(void* data, size_t count, DType dtype) override {
    if (dtype != DType::kFloat32 && dtype != DType::kFloat64 && dtype != DType::kInt32 &&
        dtype != DType::kInt64) {
      return absl::InvalidArgumentError(
          absl::StrCat("AllReduceSum: unsupported dtype ", DTypeName(dtype)));
    }
    if (count > 0 && data == nullptr) {
      return absl::InvalidArgumentError("AllReduceSum: null buffer");
    }
    return CheckHost("AllReduceSum");  // one rank: the sum is the input
  }

  absl::Status AllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    RETURN_IF_ERROR(CheckHost("AllGather"));
    if (bytes_per_rank == 0) return absl::OkStatus();
    if (send == nullptr || recv == nullptr) {
      return absl::InvalidArgumentError("AllGather: null buffer");
    }
    if (send != recv) std::memmove(recv, send, bytes_per_rank);
    return absl::OkStatus();
  }

  absl::Status AllToAllV(const void* send, absl::Span<const size_t> send_bytes, void* recv,
                         absl::Span<const size_t> recv_bytes) override {
    RETURN_IF_ERROR(CheckHost("AllToAllV"));
    if (send_bytes.size() != 1 || recv_bytes.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AllToAllV: expected 1 send and 1 recv size (one rank), got ", send_bytes.size(),
          " and ", recv_bytes.size()));
    }
    if (send_bytes[0] != recv_bytes[0]) {
      return absl::InvalidArgumentError(
          absl::StrCat("AllToAllV: rank 0 sends ", send_bytes[0], " bytes to itself but expects ",
                       recv_bytes[0]));
    }
    if (send_bytes[0] == 0) return absl::OkStatus();
    if (send == nullptr || recv == nullptr) {
      return absl::InvalidArgumentError("AllToAllV: null buffer");
    }
    if (send != recv) std::memmove(recv, send, send_bytes[0]);
    return absl::OkStatus();
  }

  absl::Status Barrier() override { return absl::OkStatus(); }

 private:
  absl::Status CheckHost(const char* op) const {
    if (space_ != MemorySpace::kHost) {
      return absl::FailedPreconditionError(
          absl::StrCat(op, ": the local communicator cannot move device memory"));
    }
    return absl::OkStatus();
  }

  const MemorySpace space_;
};

}  // namespace

std::unique_ptr<Communicator> MakeLocalCommunicator(MemorySpace space) {
  return std::make_unique<LocalCommunicator>(space);
}

}  // namespace moe
