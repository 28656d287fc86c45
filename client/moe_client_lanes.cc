// MoeClient: Forward / Backward whose tensor travels over several connections at once
// (ClientOptions::lanes; proto/moe.proto, "Staged tensors"). The input goes up as row ranges
// (StageTensor, one per lane, concurrently), the step names it and asks for its output to be
// kept, and the output comes back as row ranges (FetchStaged, concurrently), each copied once
// into the result (a new tensor, or the caller's CallOptions::output). Three phases instead of
// one call: ~2 extra round trips (well under a millisecond on a LAN) against several times the
// bandwidth of one connection, which is why only tensors of ClientOptions::lane_min_bytes or
// more take this path. The lanes' calls run on threads the client keeps (KeptThreads).
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/phase_clock.h"
#include "client/moe_client.h"
#include "engine/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/status_convert.h"
#include "proto/tensor_convert.h"
#include "proto/tensor_wire.h"

namespace moe {
namespace client {
namespace {

constexpr char kStageTensorMethod[] = "/moe.v1.MoeService/StageTensor";
constexpr char kFetchStagedMethod[] = "/moe.v1.MoeService/FetchStaged";

// Row ranges of a [rows, row_bytes] tensor: at least one per lane, none over max_part_bytes
// (the message limit) unless a single row is: offsets[i] .. offsets[i + 1].
std::vector<int64_t> PartRows(int64_t rows, size_t row_bytes, size_t lanes, size_t max_part_bytes) {
  const int64_t rows_per_part =
      std::max<int64_t>(1, max_part_bytes / std::max<size_t>(row_bytes, 1));
  const int64_t n = std::max<int64_t>(
      1, std::min<int64_t>(rows,
                           std::max<int64_t>(lanes, (rows + rows_per_part - 1) / rows_per_part)));
  std::vector<int64_t> offsets(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) offsets[i + 1] = offsets[i] + rows / n + (i < rows % n ? 1 : 0);
  return offsets;
}

// Runs fn(part, lane) for every part: lane l takes parts l, l + lanes, ... in turn, the lanes
// concurrently on `threads` (lane 0 on this thread). The first error wins.
template <typename Fn>
absl::Status RunLanes(KeptThreads* threads, size_t parts, size_t lanes, Fn fn) {
  lanes = std::min(lanes, parts);
  std::vector<absl::Status> results(lanes);
  threads->Run(lanes, [&](size_t lane) {
    for (size_t part = lane; part < parts && results[lane].ok(); part += lanes) {
      results[lane] = fn(part, lane);
    }
  });
  for (absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// A refusal after which the step still works with its tensor in the message. UNAVAILABLE: a
// lane's connection failed (the step's own channel reports the server's state itself).
bool AsksForTensorInStep(const absl::Status& status) {
  return absl::IsUnimplemented(status) || absl::IsResourceExhausted(status) ||
         absl::IsUnavailable(status);
}

}  // namespace

bool MoeClient::UsesLanes(const Tensor& tensor) const {
  return !lanes_.empty() && !lanes_refused_.load() && tensor.shape().size() == 2 &&
         tensor.num_bytes() > 0 &&
         static_cast<int64_t>(tensor.num_bytes()) >= options_.lane_min_bytes;
}

std::string MoeClient::NextStagedName() {
  return absl::StrCat(staged_prefix_, "-", next_staged_++);
}

absl::Status MoeClient::StageRows(const std::string& name, const Tensor& tensor,
                                  const CallOptions& call) {
  const int64_t rows = tensor.shape()[0];
  const size_t row_bytes = rows == 0 ? 0 : tensor.num_bytes() / rows;
  const std::vector<int64_t> offsets = PartRows(rows, row_bytes, lanes_.size(), PieceBytes());
  absl::Status status = RunLanes(
      &lane_threads_, offsets.size() - 1, lanes_.size(),
      [&](size_t i, size_t lane) -> absl::Status {
        v1::StageTensorRequest request;
        request.set_name(name);
        request.set_total_rows(rows);
        request.set_row_offset(offsets[i]);
        v1::Tensor head;
        head.set_datatype(DTypeName(tensor.dtype()));
        head.add_shape(offsets[i + 1] - offsets[i]);
        head.add_shape(tensor.shape()[1]);
        BorrowedBytes borrowed;  // waits until gRPC let go of the rows
        const absl::string_view part(
            static_cast<const char*>(tensor.raw()) + offsets[i] * row_bytes,
            (offsets[i + 1] - offsets[i]) * row_bytes);
        const grpc::ByteBuffer wire = EncodeWithTensor(
            request, v1::StageTensorRequest::kRowsFieldNumber, head, borrowed.Borrow(part));
        grpc::ClientContext context;
        Prepare(call, &context);
        grpc::ByteBuffer answer;
        return CallUnary(lanes_[lane], &context, kStageTensorMethod, wire, &answer);
      });
  if (absl::IsUnimplemented(status)) lanes_refused_ = true;
  return status;
}

absl::StatusOr<Tensor> MoeClient::FetchRows(const std::string& name, const v1::Tensor& head,
                                            const CallOptions& call) {
  ASSIGN_OR_RETURN(DType dtype, ParseDType(head.datatype()));
  if (head.shape_size() != 2) return absl::InternalError("staged output: not [rows, hidden]");
  const std::vector<int64_t> shape = {head.shape(0), head.shape(1)};
  if (call.output != nullptr)
    RETURN_IF_ERROR(CheckTensorFits(kOutputName, *call.output, dtype, shape));
  // The rows go straight into the caller's buffer when it gives one.
  Tensor out = call.output != nullptr ? Tensor::View(dtype, shape, call.output->raw())
                                      : Tensor::Uninitialized(dtype, shape);
  const size_t row_bytes = head.shape(1) * DTypeSize(dtype);
  const std::vector<int64_t> offsets =
      PartRows(head.shape(0), row_bytes, lanes_.size(), PieceBytes());
  RETURN_IF_ERROR(RunLanes(
      &lane_threads_, offsets.size() - 1, lanes_.size(),
      [&](size_t i, size_t lane) -> absl::Status {
        v1::FetchStagedRequest request;
        request.set_name(name);
        request.set_row_offset(offsets[i]);
        request.set_rows(offsets[i + 1] - offsets[i]);
        grpc::ClientContext context;
        Prepare(call, &context);
        // The server just answered the step: a lane still connecting is waited for, not failed.
        context.set_wait_for_ready(true);
        grpc::ByteBuffer answer;
        RETURN_IF_ERROR(
            CallUnary(lanes_[lane], &context, kFetchStagedMethod, EncodeMessage(request), &answer));
        v1::FetchStagedResponse response;
        TensorBytes bytes;
        RETURN_IF_ERROR(
            DecodeWithTensor(answer, v1::FetchStagedResponse::kRowsFieldNumber, &response, &bytes));
        const size_t want = (offsets[i + 1] - offsets[i]) * row_bytes;
        if (bytes.size() != want) {
          return absl::InternalError(
              absl::StrCat("FetchStaged returned ", bytes.size(), " bytes, expected ", want));
        }
        bytes.CopyTo(static_cast<char*>(out.raw()) + offsets[i] * row_bytes);
        return absl::OkStatus();
      }));
  return out;
}

template <typename Request, typename Response, typename Name, typename Rpc>
absl::StatusOr<Tensor> MoeClient::StepOverLanes(Request request, const Tensor& tensor,
                                                const CallOptions& call, bool* sent, Name name,
                                                Rpc rpc,
                                                const v1::Tensor& (Response::*answer)() const,
                                                Response* response) {
  PhaseClock clock(call.timing != nullptr);
  const std::string in = NextStagedName(), out = NextStagedName();
  absl::Status staged = StageRows(in, tensor, call);
  *sent = staged.ok() || !AsksForTensorInStep(staged);
  RETURN_IF_ERROR(staged);
  const double stage_ms = clock.Lap();
  name(&request, in, out);
  {
    grpc::ClientContext context;
    Prepare(call, &context);
    RETURN_IF_ERROR(FromGrpcStatus(rpc(&context, request, response)));
  }
  const double call_ms = clock.Lap();
  ASSIGN_OR_RETURN(Tensor result, FetchRows(out, (response->*answer)(), call));
  if (call.timing != nullptr) {
    *call.timing =
        StepTimes{stage_ms, call_ms, clock.Lap(), std::move(*response->mutable_timing())};
  }
  return result;
}

absl::StatusOr<ForwardOutput> MoeClient::ForwardOverLanes(v1::ForwardRequest request,
                                                          const Tensor& x, const CallOptions& call,
                                                          bool* sent) {
  v1::ForwardResponse response;
  ForwardOutput output;
  ASSIGN_OR_RETURN(output.out,
                   StepOverLanes(
                       std::move(request), x, call, sent,
                       [](v1::ForwardRequest* r, const std::string& in, const std::string& out) {
                         r->set_x_staged(in);
                         r->set_out_staged(out);
                       },
                       [this](grpc::ClientContext* context, const v1::ForwardRequest& r,
                              v1::ForwardResponse* a) { return stub_->Forward(context, r, a); },
                       &v1::ForwardResponse::out, &response));
  TakeForwardResults(&response, &output);
  return output;
}

absl::StatusOr<Tensor> MoeClient::BackwardOverLanes(v1::BackwardRequest request,
                                                    const Tensor& d_out, const CallOptions& call,
                                                    bool* sent) {
  v1::BackwardResponse response;
  return StepOverLanes(
      std::move(request), d_out, call, sent,
      [](v1::BackwardRequest* r, const std::string& in, const std::string& out) {
        r->set_d_out_staged(in);
        r->set_d_x_staged(out);
      },
      [this](grpc::ClientContext* context, const v1::BackwardRequest& r, v1::BackwardResponse* a) {
        return stub_->Backward(context, r, a);
      },
      &v1::BackwardResponse::d_x, &response);
}

}  // namespace client
}  // namespace moe
