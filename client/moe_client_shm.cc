// MoeClient: the shared-memory RPCs and Forward / Backward with tensors in registered regions
// (proto/moe.proto, "Shared memory"; regions from client/shared_memory.h).
#include <grpcpp/grpcpp.h>

#include "base/phase_clock.h"
#include "client/moe_client.h"
#include "engine/status_macros.h"
#include "proto/status_convert.h"

namespace moe {
namespace client {
namespace {

void ToProto(const ShmTensorRef& ref, v1::SharedMemoryTensor* proto) {
  proto->set_datatype(DTypeName(ref.dtype));
  int64_t elements = 1;
  for (int64_t d : ref.shape) {
    proto->add_shape(d);
    elements *= d;
  }
  proto->set_region(ref.region);
  proto->set_offset(ref.offset);
  proto->set_byte_size(elements * static_cast<int64_t>(DTypeSize(ref.dtype)));
}

void ToProto(const ShmOutputRef& ref, v1::SharedMemoryOutput* proto) {
  proto->set_region(ref.region);
  proto->set_offset(ref.offset);
  proto->set_byte_size(ref.byte_size);
}

}  // namespace

#define MOED_SHM_CALL(method, request, response, call) \
  grpc::ClientContext context;                         \
  Prepare(call, &context);                             \
  RETURN_IF_ERROR(FromGrpcStatus(stub_->method(&context, request, &response)))

absl::Status MoeClient::RegisterSystemSharedMemory(const std::string& name, const std::string& key,
                                                   int64_t offset, int64_t byte_size,
                                                   const CallOptions& call) {
  v1::RegisterSystemSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  v1::RegisterSystemSharedMemoryResponse response;
  MOED_SHM_CALL(RegisterSystemSharedMemory, request, response, call);
  return absl::OkStatus();
}

absl::Status MoeClient::RegisterCudaSharedMemory(const std::string& name,
                                                 const std::string& raw_handle, int64_t device_id,
                                                 int64_t byte_size, const CallOptions& call) {
  v1::RegisterCudaSharedMemoryRequest request;
  request.set_name(name);
  request.set_raw_handle(raw_handle);
  request.set_device_id(device_id);
  request.set_byte_size(byte_size);
  v1::RegisterCudaSharedMemoryResponse response;
  MOED_SHM_CALL(RegisterCudaSharedMemory, request, response, call);
  return absl::OkStatus();
}

absl::StatusOr<v1::SystemSharedMemoryStatusResponse> MoeClient::SystemSharedMemoryStatus(
    const std::string& name, const CallOptions& call) {
  v1::SystemSharedMemoryStatusRequest request;
  request.set_name(name);
  v1::SystemSharedMemoryStatusResponse response;
  MOED_SHM_CALL(SystemSharedMemoryStatus, request, response, call);
  return response;
}

absl::Status MoeClient::UnregisterSystemSharedMemory(const std::string& name,
                                                     const CallOptions& call) {
  v1::UnregisterSystemSharedMemoryRequest request;
  request.set_name(name);
  v1::UnregisterSystemSharedMemoryResponse response;
  MOED_SHM_CALL(UnregisterSystemSharedMemory, request, response, call);
  return absl::OkStatus();
}

absl::StatusOr<ForwardOutput> MoeClient::ForwardShm(const std::string& layer, const ShmTensorRef& x,
                                                    const ShmOutputRef& out, bool keep_for_backward,
                                                    const CallOptions& call) {
  v1::ForwardRequest request;
  request.set_layer(layer);
  ToProto(x, request.mutable_x_shm());
  ToProto(out, request.mutable_out_shm());
  request.set_keep_for_backward(keep_for_backward);
  PhaseClock clock(call.timing != nullptr);  // no encode or decode: the bytes are in the region
  request.set_timing(clock.enabled());
  v1::ForwardResponse response;
  if (std::optional<absl::Status> done =
          MessageOnChannel(StepKind::kForward, request, call, &response)) {
    RETURN_IF_ERROR(*done);
  } else {
    MOED_SHM_CALL(Forward, request, response, call);
  }
  if (call.timing != nullptr) {
    *call.timing = StepTimes{0.0, clock.Lap(), 0.0, std::move(*response.mutable_timing())};
  }
  ForwardOutput output;  // out stays empty: its bytes are in the region
  TakeForwardResults(&response, &output);
  return output;
}

absl::Status MoeClient::BackwardShm(const std::string& layer, uint64_t step_id,
                                    const ShmTensorRef& d_out, const ShmOutputRef& d_x,
                                    std::optional<double> d_aux, std::optional<double> d_z_loss,
                                    const CallOptions& call) {
  v1::BackwardRequest request;
  request.set_layer(layer);
  request.set_step_id(step_id);
  ToProto(d_out, request.mutable_d_out_shm());
  ToProto(d_x, request.mutable_d_x_shm());
  if (d_aux.has_value()) request.set_d_aux(*d_aux);
  if (d_z_loss.has_value()) request.set_d_z_loss(*d_z_loss);
  PhaseClock clock(call.timing != nullptr);
  request.set_timing(clock.enabled());
  v1::BackwardResponse response;
  if (std::optional<absl::Status> done =
          MessageOnChannel(StepKind::kBackward, request, call, &response)) {
    RETURN_IF_ERROR(*done);
  } else {
    MOED_SHM_CALL(Backward, request, response, call);
  }
  if (call.timing != nullptr) {
    *call.timing = StepTimes{0.0, clock.Lap(), 0.0, std::move(*response.mutable_timing())};
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace moe
