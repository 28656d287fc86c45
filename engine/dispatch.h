// Expert-parallel dispatch and combine of permuted rows (docs/SPEC.md Forward 9 and 11, Backward 2
// and 4), written once against Backend + Communicator; at R = 1 it runs the same path through
// the local communicator. Private to the engine.
//
// Layouts (rows are row_bytes wide, all buffers backend memory):
//   local    this rank's permuted rows, expert-major over all E experts:
//            [e0: A[r,e0] rows | e1 | ... | e_{E-1}]. The experts owned by rank q are
//            [q*El, (q+1)*El), so the rows bound for q are one contiguous slice.
//   source   what arrives from the all-to-all, source-major:
//            [src0: e_first..e_{first+El-1} | src1: e_first.. | ...], A[s, e] rows each.
//   expert   the FFN's layout, expert-major over local experts:
//            [el0: src0..src_{R-1} | el1: src0.. | ...]; group_rows[el] = sum_s A[s, first+el].
// A[R, E] is every rank's padded row counts (row s = rank s's per-expert rows, from its kept
// counts all-gathered in the forward).
// At R = 1 the three layouts are the same bytes (source-major with one source is expert-major),
// so the layer skips the exchange and the reorder: DispatchIsIdentity(plan).
//
//   DispatchPlan plan = BuildDispatchPlan(all_counts, ranks, rank, num_experts);
//   RETURN_IF_ERROR(DispatchRows(backend, comm, plan, x_local, x_expert, row_bytes));
//   RETURN_IF_ERROR(ReturnRows(backend, comm, plan, y_expert, y_local, row_bytes));
#ifndef MOED_ENGINE_DISPATCH_H_
#define MOED_ENGINE_DISPATCH_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/backend.h"
#include "engine/comm/communicator.h"

namespace moe {

struct DispatchPlan {
  int ranks = 1;
  int rank = 0;
  int64_t num_experts = 0;
  int64_t local_experts = 0;
  std::vector<int64_t> counts;        // A[R, E], row-major
  std::vector<int64_t> send_rows;     // [R] rows this rank sends to each peer
  std::vector<int64_t> recv_rows;     // [R] rows this rank receives from each peer
  int64_t local_rows = 0;             // rows of the local layout (sum of send_rows)
  int64_t expert_rows = 0;            // rows of the source/expert layouts (sum of recv_rows)
  std::vector<int64_t> group_rows;    // [El] rows of each local expert in the expert layout
  std::vector<RowBlock> source_to_expert;  // the local reorder; its inverse below
  std::vector<RowBlock> expert_to_source;
};

// counts: A[R, E] (host). Fails when counts has the wrong size or a negative entry.
absl::StatusOr<DispatchPlan> BuildDispatchPlan(const std::vector<int64_t>& counts, int ranks,
                                               int rank, int64_t num_experts);

// True when the local, source and expert layouts coincide (one rank): DispatchRows and
// ReturnRows would copy every row to the same offset of another buffer (twice), so the layer
// hands its local buffer to the FFN as the expert buffer, and back, without copying.
inline bool DispatchIsIdentity(const DispatchPlan& plan) { return plan.ranks == 1; }

// local -> (all-to-all) source -> (reorder) expert. `expert` holds plan.expert_rows rows.
absl::Status DispatchRows(Backend* backend, Communicator* comm, const DispatchPlan& plan,
                          const void* local, void* expert, size_t row_bytes);
// The exact inverse: expert -> source -> (all-to-all back) local (plan.local_rows rows).
absl::Status ReturnRows(Backend* backend, Communicator* comm, const DispatchPlan& plan,
                        const void* expert, void* local, size_t row_bytes);

}  // namespace moe

#endif  // MOED_ENGINE_DISPATCH_H_
