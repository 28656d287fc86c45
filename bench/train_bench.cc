// train_bench: trains one MoE layer (engine/moe_layer.h) in several compute datatypes on the
// same data and prints each loss curve as JSON, so FP8 training can be compared with BF16 at a
// benchmark size on the GPU (issue 16's training check) and at a small size on the CPU (CI).
//
//   train_bench --device=cuda:0 --compute_dtypes=bf16,fp8 --tokens=8192 --hidden=1024 \
//       --ffn=4096 --experts=8 --top_k=2 --steps=400
//   train_bench --device=cpu --tokens=256 --hidden=64 --ffn=128 --experts=4 --steps=60
//
// Task (teacher-student regression): a teacher layer of the same shape with another init seed,
// in FP32, maps --batches fixed random inputs x (normal, fixed seed) to clean targets; each
// step's target t is its batch's clean target plus label noise of --noise times the teacher's
// RMS, new at every step (a window of a fixed pool, moved by the step number), so the student
// cannot memorise it and the loss has a floor, noise^2 / (1 + noise^2), as a real task's loss
// has. With --noise=0 the student can fit the teacher exactly and each curve ends at its
// datatype's rounding floor instead. Each student (one per compute datatype, all from the same
// init seed, all seeing the same steps) trains with AdamW. Loss = mean((y - t)^2) / P with P
// the targets' expected mean square (1 = predicting zero), so d_out = 2 (y - t) / (N P),
// computed on the host in double precision; the aux loss is on (coefficient 1e-2), its gradient
// passed as d_aux = 1. One JSON line per datatype: the loss every --log_every steps, the first
// loss and the mean of the last 10; then a summary line with each datatype's final loss relative
// to the first datatype's. Times are informative only (host loss computation included).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_backend.h"
#include "engine/config.h"
#include "engine/moe_layer.h"
#include "engine/status_macros.h"
#include "engine/tensor.h"

ABSL_FLAG(std::string, device, "cpu", "cpu, cpu:THREADS or cuda:N (bench/bench_backend.h)");
ABSL_FLAG(std::string, compute_dtypes, "bf16,fp8", "students' compute datatypes, in order");
ABSL_FLAG(int64_t, tokens, 256, "T, tokens per batch");
ABSL_FLAG(int64_t, hidden, 64, "H");
ABSL_FLAG(int64_t, ffn, 128, "F");
ABSL_FLAG(int64_t, experts, 4, "E");
ABSL_FLAG(int64_t, top_k, 2, "k");
ABSL_FLAG(int, batches, 4, "fixed input batches, used in turn");
ABSL_FLAG(int, steps, 60, "optimizer steps per student");
ABSL_FLAG(double, lr, 1e-3, "AdamW learning rate");
ABSL_FLAG(int, log_every, 10, "loss recorded in the JSON every this many steps");
ABSL_FLAG(double, noise, 0.5, "label noise added to the teacher's outputs, times their RMS");
ABSL_FLAG(uint64_t, seed, 1, "students' init seed (the teacher uses seed + 1000, inputs seed + 7)");

namespace moe {
namespace {

struct Batch {
  Tensor x, target;  // target: the teacher's clean output
};

struct Data {
  std::vector<Batch> batches;
  std::vector<float> noise;   // T*H + T*H/2 values of sd noise * rms(teacher output)
  double target_power = 0.0;  // expected mean(t^2): clean mean square + noise variance
};

LayerConfig ConfigFromFlags(DType compute_dtype, uint64_t seed) {
  LayerConfig c;
  c.hidden = absl::GetFlag(FLAGS_hidden);
  c.ffn = absl::GetFlag(FLAGS_ffn);
  c.num_experts = absl::GetFlag(FLAGS_experts);
  c.top_k = absl::GetFlag(FLAGS_top_k);
  c.aux_loss_coeff = 1e-2;
  c.compute_dtype = compute_dtype;
  c.init_seed = seed;
  return c;
}

// The teacher's targets for --batches random inputs, and the noise pool.
absl::StatusOr<Data> MakeData(Backend* backend, Communicator* comm) {
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  ASSIGN_OR_RETURN(std::unique_ptr<MoeLayer> teacher,
                   MoeLayer::Create(ConfigFromFlags(DType::kFloat32, seed + 1000), backend, comm));
  const int64_t T = absl::GetFlag(FLAGS_tokens), H = absl::GetFlag(FLAGS_hidden);
  std::mt19937_64 rng(seed + 7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Data data;
  data.batches.resize(absl::GetFlag(FLAGS_batches));
  double power = 0.0;
  for (Batch& b : data.batches) {
    b.x = Tensor::Uninitialized(DType::kFloat32, {T, H});
    float* x = b.x.data<float>();
    for (int64_t i = 0; i < T * H; ++i) x[i] = normal(rng);
    ASSIGN_OR_RETURN(ForwardResult r, teacher->Forward(b.x, nullptr));
    b.target = std::move(r.out);
    const float* t = b.target.data<float>();
    for (int64_t i = 0; i < T * H; ++i) power += static_cast<double>(t[i]) * t[i];
  }
  power /= static_cast<double>(T * H) * data.batches.size();
  if (!(power > 0.0)) return absl::InternalError("teacher output is all zero");
  const double sd = absl::GetFlag(FLAGS_noise) * std::sqrt(power);
  data.noise.resize(T * H + T * H / 2);
  for (float& v : data.noise) v = static_cast<float>(sd * normal(rng));
  data.target_power = power + sd * sd;
  return data;
}

// Relative loss of `out` against step `step`'s target (its batch's clean target plus the noise
// pool's window for the step), and its gradient d_out (fp32).
double LossAndGradient(const Tensor& out, const Data& data, int step, Tensor* d_out) {
  const Batch& b = data.batches[step % data.batches.size()];
  const int64_t n = out.num_elements();
  *d_out = Tensor::Uninitialized(DType::kFloat32, out.shape());
  const float* y = out.data<float>();
  const float* t = b.target.data<float>();
  const float* noise =
      data.noise.data() + (static_cast<int64_t>(step) * 7919) % (data.noise.size() - n + 1);
  float* d = d_out->data<float>();
  const double norm = static_cast<double>(n) * data.target_power;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(y[i]) - (t[i] + noise[i]);
    sum += e * e;
    d[i] = static_cast<float>(2.0 * e / norm);
  }
  return sum / norm;
}

struct Curve {
  std::string dtype;
  std::vector<double> losses;
  double seconds = 0.0;
  double Final() const {
    const size_t n = std::min<size_t>(10, losses.size());
    double s = 0.0;
    for (size_t i = losses.size() - n; i < losses.size(); ++i) s += losses[i];
    return n == 0 ? 0.0 : s / n;
  }
};

absl::StatusOr<Curve> Train(Backend* backend, Communicator* comm, DType compute_dtype,
                            const Data& data) {
  Curve curve;
  curve.dtype = ComputeDTypeName(compute_dtype);
  ASSIGN_OR_RETURN(
      std::unique_ptr<MoeLayer> student,
      MoeLayer::Create(ConfigFromFlags(compute_dtype, absl::GetFlag(FLAGS_seed)), backend, comm));
  const OptimizerConfig adamw = OptimizerConfig::AdamW(absl::GetFlag(FLAGS_lr));
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < absl::GetFlag(FLAGS_steps); ++step) {
    std::unique_ptr<StepContext> saved;
    ASSIGN_OR_RETURN(ForwardResult r,
                     student->Forward(data.batches[step % data.batches.size()].x, &saved));
    Tensor d_out;
    const double loss = LossAndGradient(r.out, data, step, &d_out);
    if (!std::isfinite(loss)) {
      return absl::InternalError(absl::StrCat(curve.dtype, ": loss ", loss, " at step ", step));
    }
    curve.losses.push_back(loss);
    RETURN_IF_ERROR(student->Backward(*saved, d_out, /*d_aux=*/1.0, /*d_z_loss=*/0.0).status());
    RETURN_IF_ERROR(student->ApplyOptimizer(adamw));
  }
  curve.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return curve;
}

std::string CurveJson(const Curve& c) {
  std::vector<std::string> logged;
  const int every = std::max(1, absl::GetFlag(FLAGS_log_every));
  for (size_t i = 0; i < c.losses.size(); i += every) logged.push_back(absl::StrCat(c.losses[i]));
  return absl::StrCat(
      "{\"bench\": \"train_bench\", \"device\": \"", absl::GetFlag(FLAGS_device),
      "\", \"compute_dtype\": \"", c.dtype, "\", \"tokens\": ", absl::GetFlag(FLAGS_tokens),
      ", \"hidden\": ", absl::GetFlag(FLAGS_hidden), ", \"ffn\": ", absl::GetFlag(FLAGS_ffn),
      ", \"experts\": ", absl::GetFlag(FLAGS_experts), ", \"top_k\": ", absl::GetFlag(FLAGS_top_k),
      ", \"steps\": ", c.losses.size(), ", \"lr\": ", absl::GetFlag(FLAGS_lr),
      ", \"noise\": ", absl::GetFlag(FLAGS_noise),
      ", \"loss_first\": ", c.losses.empty() ? 0.0 : c.losses.front(),
      ", \"loss_final\": ", c.Final(), ", \"seconds\": ", c.seconds, ", \"log_every\": ", every,
      ", \"losses\": [", absl::StrJoin(logged, ", "), "]}");
}

absl::Status Run() {
  if (absl::GetFlag(FLAGS_steps) <= 0 || absl::GetFlag(FLAGS_batches) <= 0) {
    return absl::InvalidArgumentError("--steps and --batches must be positive");
  }
  std::vector<DType> dtypes;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_compute_dtypes), ',')) {
    ASSIGN_OR_RETURN(DType d, ParseComputeDType(absl::AsciiStrToUpper(name)));
    dtypes.push_back(d);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, MakeBenchBackend(absl::GetFlag(FLAGS_device)));
  ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, MakeBenchCommunicator(*backend));
  ASSIGN_OR_RETURN(Data data, MakeData(backend.get(), comm.get()));
  std::vector<Curve> curves;
  for (DType d : dtypes) {
    ASSIGN_OR_RETURN(Curve c, Train(backend.get(), comm.get(), d, data));
    std::printf("%s\n", CurveJson(c).c_str());
    std::fflush(stdout);
    curves.push_back(std::move(c));
  }
  std::vector<std::string> ratios;
  for (const Curve& c : curves) {
    ratios.push_back(absl::StrCat("\"", c.dtype, "\": ", c.Final() / curves.front().Final()));
  }
  std::printf(
      "{\"bench\": \"train_bench\", \"summary\": \"final loss / %s's final loss\", "
      "\"final_ratio\": {%s}}\n",
      curves.front().dtype.c_str(), absl::StrJoin(ratios, ", ").c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = moe::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "train_bench: %s\n", status.ToString().c_str());
    return absl::IsInvalidArgument(status) || absl::IsUnimplemented(status) ? 2 : 1;
  }
  return 0;
}
