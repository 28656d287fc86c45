// The reference router (docs/SPEC.md Forward 2-4 and 7), in double precision, one token at a time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "tests/reference/reference_moe.h"

namespace moe_ref {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double Sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// Records a decision-boundary gap; exact ties are decided by index rules in every
// implementation, so only non-zero gaps count.
void NoteGap(double a, double b, double* min_gap) {
  if (a == kNegInf || b == kNegInf) return;
  double gap = std::fabs(a - b);
  if (gap > 0.0 && gap < *min_gap) *min_gap = gap;
}

// Indices of `values` ordered by value descending, ties toward the lower index.
std::vector<int64_t> OrderDescending(const std::vector<double>& values) {
  std::vector<int64_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return values[a] > values[b]; });
  return order;
}

}  // namespace

RefRouting RefRoute(const RefConfig& c, const RefParams& params, const std::vector<double>& logits,
                    int64_t tokens) {
  const int64_t E = c.num_experts;
  const int64_t k = c.top_k;
  RefRouting r;
  r.selected.assign(tokens * E, 0);
  r.kept.assign(tokens * E, 0);
  r.p.assign(tokens * E, 0.0);
  r.probs.assign(tokens * E, 0.0);
  r.scores.assign(tokens * E, 0.0);

  for (int64_t t = 0; t < tokens; ++t) {
    const double* z = &logits[t * E];
    double* s = &r.scores[t * E];
    // Scores: softmax over all E, or the element-wise sigmoid.
    if (c.score == RefScore::kSoftmax) {
      double mx = *std::max_element(z, z + E);
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(z[e] - mx);
      for (int64_t e = 0; e < E; ++e) s[e] = std::exp(z[e] - mx) / sum;
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = Sigmoid(z[e]);
    }
    // Selection scores.
    std::vector<double> sel(E);
    for (int64_t e = 0; e < E; ++e) {
      if (c.score == RefScore::kSoftmax) {
        sel[e] = c.pre_softmax ? s[e] : z[e];
      } else {
        sel[e] = s[e] + (c.use_expert_bias ? params.expert_bias[e] : 0.0);
      }
    }
    // Grouped top-k: group score = sum of the top k/group_topk scores of the group.
    if (c.num_groups > 0 && c.group_topk > 0) {
      const int64_t per_group = E / c.num_groups;
      const int64_t m = k / c.group_topk;
      std::vector<double> group_score(c.num_groups, 0.0);
      for (int64_t g = 0; g < c.num_groups; ++g) {
        std::vector<double> members(sel.begin() + g * per_group, sel.begin() + (g + 1) * per_group);
        std::sort(members.begin(), members.end(), std::greater<double>());
        for (int64_t i = 0; i < m; ++i) group_score[g] += members[i];
      }
      std::vector<int64_t> group_order = OrderDescending(group_score);
      if (c.group_topk < c.num_groups) {
        NoteGap(group_score[group_order[c.group_topk - 1]], group_score[group_order[c.group_topk]],
                &r.min_selection_gap);
      }
      for (int64_t i = c.group_topk; i < c.num_groups; ++i) {
        const int64_t g = group_order[i];
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) sel[e] = kNegInf;
      }
    }
    std::vector<int64_t> order = OrderDescending(sel);
    if (k < E) NoteGap(sel[order[k - 1]], sel[order[k]], &r.min_selection_gap);
    for (int64_t i = 0; i < k; ++i) r.selected[t * E + order[i]] = 1;

    // Routing weights p on S.
    double* p = &r.p[t * E];
    const uint8_t* in_s = &r.selected[t * E];
    if (c.score == RefScore::kSoftmax && c.pre_softmax) {
      for (int64_t e = 0; e < E; ++e) p[e] = in_s[e] ? s[e] : 0.0;
    } else if (c.score == RefScore::kSoftmax) {
      double mx = kNegInf;
      for (int64_t e = 0; e < E; ++e) {
        if (in_s[e]) mx = std::max(mx, z[e]);
      }
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        if (in_s[e]) sum += std::exp(z[e] - mx);
      }
      for (int64_t e = 0; e < E; ++e) p[e] = in_s[e] ? std::exp(z[e] - mx) / sum : 0.0;
    } else if (k > 1) {
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        if (in_s[e]) sum += s[e];
      }
      for (int64_t e = 0; e < E; ++e) p[e] = in_s[e] ? s[e] / (sum + 1e-20) : 0.0;
    } else {
      for (int64_t e = 0; e < E; ++e) p[e] = in_s[e] ? s[e] : 0.0;
    }
    for (int64_t e = 0; e < E; ++e) {
      r.probs[t * E + e] = c.scaling_factor * p[e];
      r.kept[t * E + e] = in_s[e];
    }
  }

  // Capacity: per expert keep the ceil(cf * T * k / E) pairs of highest probs; among equal
  // probs the earlier token is kept (the later one is dropped first).
  if (c.capacity_factor > 0.0) {
    r.capacity = static_cast<int64_t>(
        std::ceil(c.capacity_factor * static_cast<double>(tokens) * k / static_cast<double>(E)));
    for (int64_t e = 0; e < E; ++e) {
      std::vector<int64_t> pairs;
      for (int64_t t = 0; t < tokens; ++t) {
        if (r.selected[t * E + e]) pairs.push_back(t);
      }
      if (static_cast<int64_t>(pairs.size()) <= r.capacity) continue;
      std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) {
        return r.probs[a * E + e] > r.probs[b * E + e];
      });
      if (r.capacity > 0) {
        NoteGap(r.probs[pairs[r.capacity - 1] * E + e], r.probs[pairs[r.capacity] * E + e],
                &r.min_capacity_gap);
      }
      for (size_t i = r.capacity; i < pairs.size(); ++i) r.kept[pairs[i] * E + e] = 0;
    }
  }
  return r;
}

}  // namespace moe_ref
