#include "engine/dispatch.h"

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

std::vector<size_t> ToBytes(const std::vector<int64_t>& rows, size_t row_bytes) {
  std::vector<size_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = static_cast<size_t>(rows[i]) * row_bytes;
  return out;
}

}  // namespace

absl::StatusOr<DispatchPlan> BuildDispatchPlan(const std::vector<int64_t>& counts, int ranks,
                                               int rank, int64_t num_experts) {
  if (ranks <= 0 || rank < 0 || rank >= ranks || num_experts % ranks != 0 ||
      counts.size() != static_cast<size_t>(ranks * num_experts)) {
    return absl::InvalidArgumentError(absl::StrCat("dispatch: bad plan input (ranks=", ranks,
                                                   " rank=", rank, " experts=", num_experts,
                                                   " counts=", counts.size(), ")"));
  }
  for (int64_t c : counts) {
    if (c < 0) return absl::InternalError("dispatch: negative row count exchanged");
  }
  DispatchPlan p;
  p.ranks = ranks;
  p.rank = rank;
  p.num_experts = num_experts;
  p.local_experts = num_experts / ranks;
  p.counts = counts;
  const int64_t El = p.local_experts, first = rank * El;
  auto A = [&](int s, int64_t e) { return counts[s * num_experts + e]; };
  p.send_rows.assign(ranks, 0);
  p.recv_rows.assign(ranks, 0);
  p.group_rows.assign(El, 0);
  for (int q = 0; q < ranks; ++q) {
    for (int64_t el = 0; el < El; ++el) {
      p.send_rows[q] += A(rank, q * El + el);  // my rows for q's experts
      p.recv_rows[q] += A(q, first + el);      // q's rows for my experts
      p.group_rows[el] += A(q, first + el);
    }
    p.local_rows += p.send_rows[q];
    p.expert_rows += p.recv_rows[q];
  }
  // Block (source s, local expert el): source-layout offset vs expert-layout offset.
  std::vector<int64_t> expert_start(El, 0);
  for (int64_t el = 1; el < El; ++el) expert_start[el] = expert_start[el - 1] + p.group_rows[el - 1];
  std::vector<int64_t> expert_cursor = expert_start;
  int64_t source_row = 0;
  for (int s = 0; s < ranks; ++s) {
    for (int64_t el = 0; el < El; ++el) {
      const int64_t n = A(s, first + el);
      if (n > 0) {
        p.source_to_expert.push_back(RowBlock{source_row, expert_cursor[el], n});
        p.expert_to_source.push_back(RowBlock{expert_cursor[el], source_row, n});
      }
      source_row += n;
      expert_cursor[el] += n;
    }
  }
  return p;
}

absl::Status DispatchRows(Backend* backend, Communicator* comm, const DispatchPlan& plan,
                          const void* local, void* expert, size_t row_bytes) {
  ASSIGN_OR_RETURN(Buffer source, backend->Allocate(plan.expert_rows * row_bytes));
  RETURN_IF_ERROR(comm->AllToAllV(local, ToBytes(plan.send_rows, row_bytes), source.data(),
                                  ToBytes(plan.recv_rows, row_bytes)));
  return backend->CopyRowBlocks(source.data(), expert, row_bytes, plan.source_to_expert);
}

absl::Status ReturnRows(Backend* backend, Communicator* comm, const DispatchPlan& plan,
                        const void* expert, void* local, size_t row_bytes) {
  ASSIGN_OR_RETURN(Buffer source, backend->Allocate(plan.expert_rows * row_bytes));
  RETURN_IF_ERROR(backend->CopyRowBlocks(expert, source.data(), row_bytes, plan.expert_to_source));
  return comm->AllToAllV(source.data(), ToBytes(plan.recv_rows, row_bytes), local,
                         ToBytes(plan.send_rows, row_bytes));
}

}  // namespace moe
