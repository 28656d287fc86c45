// MoeServiceImpl: client shared-memory regions (proto/moe.proto, "Shared memory"). The RPCs
// keep the book (server/shared_memory.h); Forward and Backward call PrepareShm to lease the
// regions a step names and cut them into worker slices (server/shm_step.h); the workers map
// the regions themselves (server/worker_shm.h) and are told to unmap a region once no step
// uses it (ForgetRetiredShm).
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/status_convert.h"
#include "server/moe_service.h"

namespace moe {

absl::Status MoeServiceImpl::CheckShmAllowed(grpc::ServerContextBase* context) const {
  return CheckShmAllowed(context->peer());
}

absl::Status MoeServiceImpl::CheckShmAllowed(const std::string& peer) const {
  if (shm_ == nullptr) {
    return absl::UnimplementedError(
        "client shared memory is off: start moed with --allow_client_shm");
  }
  if (!IsLocalPeer(peer)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shared memory is only for callers on moed's host; this call came from ", peer));
  }
  return absl::OkStatus();
}

std::string MoeServiceImpl::ShmOwnerOf(const grpc::ServerContextBase& context) const {
  // With tokens, the token's identity (as staged tensors). Without, every caller is one
  // identity: shared memory is for callers on this host, and without tokens moed serves one
  // user on loopback (docs/SECURITY.md); a caller's address would split one client's IPv4
  // and IPv6 or unix connections.
  return ShmOwnerOfClient(ClientOf(context));
}

std::string MoeServiceImpl::ShmOwnerOfClient(const std::string& client) const {
  return options_.auth != nullptr ? client : std::string();
}

absl::StatusOr<ShmStep> MoeServiceImpl::PrepareShm(const StepCaller& caller,
                                                   const v1::ForwardRequest& request,
                                                   int64_t hidden) {
  ShmStep shm;
  if (!request.has_x_shm() && !request.has_out_shm()) return shm;
  RETURN_IF_ERROR(CheckShmAllowed(caller.peer()));
  if (request.has_x_shm()) {
    ASSIGN_OR_RETURN(ShmLease lease,
                     shm_->Acquire("x_shm.region", ShmOwnerOfClient(caller.client()), request.x_shm().region()));
    RETURN_IF_ERROR(shm.SetInput("x_shm", request.x_shm(), hidden, std::move(lease)));
  }
  if (request.has_out_shm()) {
    ASSIGN_OR_RETURN(ShmLease lease, shm_->Acquire("out_shm.region", ShmOwnerOfClient(caller.client()),
                                                   request.out_shm().region()));
    RETURN_IF_ERROR(shm.SetOutput("out_shm", request.out_shm(), std::move(lease)));
  }
  return shm;
}

absl::StatusOr<ShmStep> MoeServiceImpl::PrepareShm(const StepCaller& caller,
                                                   const v1::BackwardRequest& request,
                                                   int64_t hidden) {
  ShmStep shm;
  if (!request.has_d_out_shm() && !request.has_d_x_shm()) return shm;
  RETURN_IF_ERROR(CheckShmAllowed(caller.peer()));
  if (request.has_d_out_shm()) {
    ASSIGN_OR_RETURN(ShmLease lease, shm_->Acquire("d_out_shm.region", ShmOwnerOfClient(caller.client()),
                                                   request.d_out_shm().region()));
    RETURN_IF_ERROR(shm.SetInput("d_out_shm", request.d_out_shm(), hidden, std::move(lease)));
  }
  if (request.has_d_x_shm()) {
    ASSIGN_OR_RETURN(ShmLease lease, shm_->Acquire("d_x_shm.region", ShmOwnerOfClient(caller.client()),
                                                   request.d_x_shm().region()));
    RETURN_IF_ERROR(shm.SetOutput("d_x_shm", request.d_x_shm(), std::move(lease)));
  }
  return shm;
}

absl::StatusOr<RelayStep> MoeServiceImpl::RelayLocally(const WorkerSet& set,
                                                       const RelayRequest& request,
                                                       ShmStep* shm) {
  const absl::string_view in_field = request.in_field;
  const TensorBytes& input = *request.input;
  std::shared_ptr<RelayBuffer> staged = request.staged;
  const DType in_dtype = request.in_dtype;
  const absl::string_view out_field = request.out_field;
  const DType out_dtype = request.out_dtype;
  const int64_t tokens = request.tokens;
  const int64_t hidden = request.hidden;
  RelayStep relay;
  if (relay_ == nullptr || !set.local || tokens == 0) return relay;
  SharedMemoryRegistry* registry = relay_->registry();
  if (staged != nullptr) {
    relay.input = std::move(staged);  // already in a relay buffer: no copy
  } else if (!shm->has_input() && input.size() > 0 && (relay.input = relay_->Take(input.size()))) {
    input.CopyTo(relay.input->data);  // the one copy of the request's bytes
  }
  if (relay.input != nullptr && !shm->has_input()) {
    v1::SharedMemoryTensor tensor;
    tensor.set_datatype(std::string(DTypeName(in_dtype)));
    tensor.add_shape(tokens);
    tensor.add_shape(hidden);
    tensor.set_region(relay.input->name);
    tensor.set_byte_size(static_cast<int64_t>(input.size()));
    ASSIGN_OR_RETURN(ShmLease lease, registry->Acquire(in_field, "", relay.input->name));
    RETURN_IF_ERROR(shm->SetInput(in_field, tensor, hidden, std::move(lease)));
  }
  const int64_t out_bytes = tokens * hidden * static_cast<int64_t>(DTypeSize(out_dtype));
  if (!shm->has_output() && (relay.output = relay_->Take(out_bytes))) {
    v1::SharedMemoryOutput output;
    output.set_region(relay.output->name);
    output.set_byte_size(out_bytes);
    ASSIGN_OR_RETURN(ShmLease lease, registry->Acquire(out_field, "", relay.output->name));
    RETURN_IF_ERROR(shm->SetOutput(out_field, output, std::move(lease)));
    RETURN_IF_ERROR(shm->CheckOutput(tokens, hidden, out_dtype));
    relay.output_bytes = out_bytes;
  }
  return relay;
}

void MoeServiceImpl::ForgetRetiredShm() {
  // Client regions, and relay buffers the pool unmapped (evicted, or discarded after a failed
  // step): the workers would otherwise keep the deleted object mapped until their idle unmap.
  std::vector<uint64_t> ids = shm_ != nullptr ? shm_->TakeRetired() : std::vector<uint64_t>{};
  if (relay_ != nullptr) {
    for (uint64_t id : relay_->registry()->TakeRetired()) ids.push_back(id);
  }
  if (ids.empty()) return;
  // Workers that are down now drop their mappings themselves once unused (worker_shm.h).
  absl::StatusOr<WorkerSet> set = pool_->Serving();
  if (!set.ok()) return;
  internal::ForgetSharedMemoryRequest call;
  for (uint64_t id : ids) call.add_region_ids(id);
  pool_
      ->ForEachWorker(
          *set, absl::Now() + options_.step_timeout,
          [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
            internal::WorkerEmpty empty;
            return FromGrpcStatus(stub->ForgetSharedMemory(ctx, call, &empty));
          },
          /*collective=*/false)
      .IgnoreError();
}

void MoeServiceImpl::HousekeepShm() {
  if (shm_ != nullptr) shm_->DropStale(absl::Now());
  ForgetRetiredShm();
}

grpc::Status MoeServiceImpl::DoRegisterSystemSharedMemory(
    grpc::ServerContextBase* context, const v1::RegisterSystemSharedMemoryRequest* request,
    v1::RegisterSystemSharedMemoryResponse*) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "RegisterSystemSharedMemory");
  absl::Status status = CheckShmAllowed(context);
  if (status.ok()) {
    status = shm_->Register(ShmOwnerOf(*context), request->name(), request->key(),
                            request->offset(), request->byte_size());
  }
  return Finish("RegisterSystemSharedMemory", start, status);
}

grpc::Status MoeServiceImpl::DoRegisterCudaSharedMemory(
    grpc::ServerContextBase* context, const v1::RegisterCudaSharedMemoryRequest* request,
    v1::RegisterCudaSharedMemoryResponse*) {
  const absl::Time start = absl::Now();
  absl::Status status = CheckShmAllowed(context);
  if (status.ok()) {
    // The workers open the region on their GPUs: refuse it up front on CPU workers.
    for (const v1::WorkerStatus& worker : pool_->WorkerStatuses()) {
      if (!worker.device().empty() && !absl::StartsWith(worker.device(), "cuda")) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "CUDA shared memory needs CUDA workers; worker ", worker.rank(), " runs on \"",
            worker.device(), "\" (use RegisterSystemSharedMemory)"));
        break;
      }
    }
  }
  if (status.ok()) {
    status = shm_->RegisterCuda(ShmOwnerOf(*context), request->name(), request->raw_handle(),
                                request->device_id(), request->byte_size());
  }
  return Finish("RegisterCudaSharedMemory", start, status);
}

absl::Status MoeServiceImpl::ShmStatus(grpc::ServerContextBase* context, const std::string& name,
                                       v1::SystemSharedMemoryStatusResponse* response) {
  RETURN_IF_ERROR(CheckShmAllowed(context));
  ASSIGN_OR_RETURN(std::vector<ShmRegionStatus> regions, shm_->Status(ShmOwnerOf(*context), name));
  for (const ShmRegionStatus& r : regions) {
    auto* out = response->add_regions();
    out->set_name(r.region.name);
    out->set_key(r.region.key);
    out->set_offset(r.region.offset);
    out->set_byte_size(r.region.byte_size);
    out->set_steps_in_flight(r.steps_in_flight);
    if (r.region.cuda()) out->set_cuda_device_id(r.region.cuda_device);
    out->set_cuda(r.region.cuda());
  }
  return absl::OkStatus();
}

grpc::Status MoeServiceImpl::DoSystemSharedMemoryStatus(
    grpc::ServerContextBase* context, const v1::SystemSharedMemoryStatusRequest* request,
    v1::SystemSharedMemoryStatusResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "SystemSharedMemoryStatus");
  absl::Status status = ShmStatus(context, request->name(), response);
  ForgetRetiredShm();  // Status drops stale regions
  return Finish("SystemSharedMemoryStatus", start, status);
}

grpc::Status MoeServiceImpl::DoUnregisterSystemSharedMemory(
    grpc::ServerContextBase* context, const v1::UnregisterSystemSharedMemoryRequest* request,
    v1::UnregisterSystemSharedMemoryResponse*) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "UnregisterSystemSharedMemory");
  absl::Status status = CheckShmAllowed(context);
  if (status.ok()) status = shm_->Unregister(ShmOwnerOf(*context), request->name());
  ForgetRetiredShm();
  return Finish("UnregisterSystemSharedMemory", start, status);
}

}  // namespace moe
