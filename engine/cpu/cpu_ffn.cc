// Expert FFN element-wise pieces (activation, biases) and the optimizer step on the CPU.
// h/a/d_a/d_h are stored in the compute dtype; the arithmetic is fp32 (double inside the
// transcendental functions), rounded once per stored element.
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/parallel.h"

namespace moe {
namespace cpu {
namespace {

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;

double Act(Activation act, double x) {
  switch (act) {
    case Activation::kSilu:
      return x / (1.0 + std::exp(-x));
    case Activation::kGelu:
      return 0.5 * x * (1.0 + std::tanh(kGeluC * (x + kGeluA * x * x * x)));
    case Activation::kRelu:
      return x > 0 ? x : 0.0;
    case Activation::kLinear:
      return x;
  }
  return x;
}

double ActGrad(Activation act, double x) {
  switch (act) {
    case Activation::kSilu: {
      const double s = 1.0 / (1.0 + std::exp(-x));
      return s * (1.0 + x * (1.0 - s));
    }
    case Activation::kGelu: {
      const double inner = kGeluC * (x + kGeluA * x * x * x);
      const double th = std::tanh(inner);
      return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * kGeluC * (1.0 + 3.0 * kGeluA * x * x);
    }
    case Activation::kRelu:
      return x > 0 ? 1.0 : 0.0;
    case Activation::kLinear:
      return 1.0;
  }
  return 1.0;
}

// Row -> group map from the per-group row counts; fails when they do not add up to `rows`.
absl::Status GroupOfRows(const char* op, GroupRows group_rows, int64_t rows,
                         std::vector<int32_t>* group_of_row) {
  group_of_row->assign(static_cast<size_t>(rows), 0);
  int64_t r = 0;
  for (size_t g = 0; g < group_rows.size(); ++g) {
    if (group_rows[g] < 0 || r + group_rows[g] > rows) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": group_rows do not add up to ", rows, " rows"));
    }
    for (int64_t i = 0; i < group_rows[g]; ++i) (*group_of_row)[r++] = static_cast<int32_t>(g);
  }
  if (r != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": group_rows add up to ", r, " rows, expected ", rows));
  }
  return absl::OkStatus();
}

// ActivationArgs::amax: *amax = max(*amax, max |out[i]|) over the stored values.
void MaxAbsInto(const void* out, DType dtype, int64_t count, float* amax) {
  if (amax == nullptr) return;
  float m = *amax;
  for (int64_t i = 0; i < count; ++i) m = std::fmax(m, std::fabs(LoadFloat(out, dtype, i)));
  *amax = m;
}

int64_t TotalRows(GroupRows group_rows) {
  int64_t n = 0;
  for (int64_t r : group_rows) n += r;
  return n;
}

}  // namespace

absl::Status ActivationForward(const ActivationArgs& a, int threads) {
  if (absl::Status s = CheckFloatType("ActivationForward", "dtype", a.dtype); !s.ok()) return s;
  if (a.rows < 0 || a.ffn <= 0) return absl::InvalidArgumentError("ActivationForward: bad sizes");
  const int64_t up = a.gated ? 2 * a.ffn : a.ffn;
  std::vector<int32_t> group_of_row;
  if (a.up_bias != nullptr) {
    if (absl::Status s = GroupOfRows("ActivationForward", a.group_rows, a.rows, &group_of_row);
        !s.ok()) {
      return s;
    }
  }
  ParallelFor(threads, a.rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (a.up_bias != nullptr) {
        const float* bias = a.up_bias + group_of_row[r] * up;
        for (int64_t i = 0; i < up; ++i) {
          StoreFloat(a.h, a.dtype, r * up + i, LoadFloat(a.h, a.dtype, r * up + i) + bias[i]);
        }
      }
      for (int64_t f = 0; f < a.ffn; ++f) {
        const double g = LoadFloat(a.h, a.dtype, r * up + f);
        double v = Act(a.activation, g);
        if (a.gated) v *= LoadFloat(a.h, a.dtype, r * up + a.ffn + f);
        StoreFloat(a.a, a.dtype, r * a.ffn + f, static_cast<float>(v));
      }
    }
  });
  MaxAbsInto(a.a, a.dtype, a.rows * a.ffn, a.amax);
  return absl::OkStatus();
}

absl::Status ActivationBackward(const ActivationArgs& a, int threads) {
  if (absl::Status s = CheckFloatType("ActivationBackward", "dtype", a.dtype); !s.ok()) return s;
  if (a.rows < 0 || a.ffn <= 0) {
    return absl::InvalidArgumentError("ActivationBackward: bad sizes");
  }
  const int64_t up = a.gated ? 2 * a.ffn : a.ffn;
  ParallelFor(threads, a.rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t f = 0; f < a.ffn; ++f) {
        const double g = LoadFloat(a.h, a.dtype, r * up + f);
        const double da = LoadFloat(a.d_a, a.dtype, r * a.ffn + f);
        if (a.gated) {
          const double u = LoadFloat(a.h, a.dtype, r * up + a.ffn + f);
          StoreFloat(a.d_h, a.dtype, r * up + f,
                     static_cast<float>(da * u * ActGrad(a.activation, g)));
          StoreFloat(a.d_h, a.dtype, r * up + a.ffn + f,
                     static_cast<float>(da * Act(a.activation, g)));
        } else {
          StoreFloat(a.d_h, a.dtype, r * up + f,
                     static_cast<float>(da * ActGrad(a.activation, g)));
        }
      }
    }
  });
  MaxAbsInto(a.d_h, a.dtype, a.rows * up, a.amax);
  return absl::OkStatus();
}

absl::Status AddGroupBias(void* y, DType dtype, const float* bias, int64_t width,
                          GroupRows group_rows, int threads) {
  if (absl::Status s = CheckFloatType("AddGroupBias", "dtype", dtype); !s.ok()) return s;
  const int64_t rows = TotalRows(group_rows);
  std::vector<int32_t> group_of_row;
  if (absl::Status s = GroupOfRows("AddGroupBias", group_rows, rows, &group_of_row); !s.ok()) {
    return s;
  }
  ParallelFor(threads, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* b = bias + group_of_row[r] * width;
      for (int64_t i = 0; i < width; ++i) {
        StoreFloat(y, dtype, r * width + i, LoadFloat(y, dtype, r * width + i) + b[i]);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status GroupBiasGrad(const void* d_y, DType dtype, int64_t width, GroupRows group_rows,
                           float* d_bias, int threads) {
  if (absl::Status s = CheckFloatType("GroupBiasGrad", "dtype", dtype); !s.ok()) return s;
  // Parallel over columns; each column sums its rows in row order (fixed order).
  ParallelFor(threads, width, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(end - begin);
    int64_t row = 0;
    for (size_t g = 0; g < group_rows.size(); ++g) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t r = row; r < row + group_rows[g]; ++r) {
        for (int64_t i = begin; i < end; ++i) acc[i - begin] += LoadFloat(d_y, dtype, r * width + i);
      }
      for (int64_t i = begin; i < end; ++i) d_bias[g * width + i] += acc[i - begin];
      row += group_rows[g];
    }
  });
  return absl::OkStatus();
}

absl::Status OptimizerStep(const Backend::OptimizerArgs& o, float* param, const float* grad,
                           float* m, float* v, int64_t count, int threads) {
  if (count < 0) return absl::InvalidArgumentError("OptimizerStep: negative count");
  if (count == 0) return absl::OkStatus();
  if (param == nullptr || grad == nullptr) {
    return absl::InvalidArgumentError("OptimizerStep: null param/grad");
  }
  if (o.adamw) {
    if (m == nullptr || v == nullptr) {
      return absl::InvalidArgumentError("OptimizerStep: AdamW needs both moment buffers");
    }
    if (o.step < 1) return absl::InvalidArgumentError("OptimizerStep: AdamW step counts from 1");
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(o.step));
    const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(o.step));
    ParallelFor(threads, count, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const double g = grad[i] * o.grad_scale;
        const double mi = o.beta1 * m[i] + (1.0 - o.beta1) * g;
        const double vi = o.beta2 * v[i] + (1.0 - o.beta2) * g * g;
        m[i] = static_cast<float>(mi);
        v[i] = static_cast<float>(vi);
        const double update = (mi / bc1) / (std::sqrt(vi / bc2) + o.eps) + o.weight_decay * param[i];
        param[i] = static_cast<float>(param[i] - o.lr * update);
      }
    });
    return absl::OkStatus();
  }
  if (o.momentum != 0.0 && m == nullptr) {
    return absl::InvalidArgumentError("OptimizerStep: SGD with momentum needs a momentum buffer");
  }
  ParallelFor(threads, count, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      double d = static_cast<double>(grad[i]) * o.grad_scale + o.weight_decay * param[i];
      if (o.momentum != 0.0) {
        d = o.momentum * m[i] + d;
        m[i] = static_cast<float>(d);
      }
      param[i] = static_cast<float>(param[i] - o.lr * d);
    }
  });
  return absl::OkStatus();
}

}  // namespace cpu
}  // namespace moe
