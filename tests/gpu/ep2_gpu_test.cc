// EP=2 on two GPUs equals EP=1 (GPU machine with 2 GPUs only; tagged manual). Two worker
// processes (tests/harness), rank r on GPU r, joined by the NCCL communicator through a
// file-backed store. Each rank also runs the EP=1 layer on the whole global batch on its own
// GPU (NCCL with one rank) and compares its token slice of out and d_x, aux/z-loss, the
// global tokens_per_expert, the gate gradient and its shard of every expert gradient:
// fp32 rel. <= 1e-5, bf16 <= 2e-2.
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/comm/file_kv_store.h"
#include "engine/comm/memory_kv_store.h"
#include "engine/comm/nccl_communicator.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/moe_layer.h"
#include "engine/status_macros.h"
#include "gtest/gtest.h"
#include "tests/gpu/backend_pair.h"
#include "tests/harness/multiprocess.h"

namespace moe {
namespace gpu_test {
namespace {

struct EpCase {
  std::string name;
  LayerConfig config;
  int64_t tokens;        // global
  int64_t rank0_tokens;  // rank 0's slice [0, rank0_tokens), rank 1 the rest
  bool hot = false;      // every token to rank 0's experts
};

std::vector<EpCase> Cases() {
  std::vector<EpCase> v;
  auto base = [](int64_t H, int64_t F, int64_t E, int64_t k, DType d) {
    LayerConfig c;
    c.hidden = H, c.ffn = F, c.num_experts = E, c.top_k = k, c.compute_dtype = d;
    c.init_seed = 3;
    return c;
  };
  {
    EpCase c{"softmax_aux_z_fp32", base(64, 128, 8, 2, DType::kFloat32), 256, 100};
    c.config.aux_loss_coeff = 1e-2, c.config.z_loss_coeff = 1e-3;
    v.push_back(c);
  }
  {
    EpCase c{"sigmoid_grouped_align_zero_rank_fp32", base(64, 64, 32, 4, DType::kFloat32), 200, 0};
    LayerConfig& k = c.config;
    k.score_function = ScoreFunction::kSigmoid, k.num_groups = 8, k.group_topk = 4;
    k.use_expert_bias = true, k.align_size = 8, k.use_bias = true, k.aux_loss_coeff = 1e-2;
    v.push_back(c);
  }
  {
    EpCase c{"hot_rank0_fp32", base(32, 64, 8, 2, DType::kFloat32), 128, 90};
    c.hot = true;
    v.push_back(c);
  }
  v.push_back({"softmax_bf16", base(128, 256, 16, 4, DType::kBFloat16), 512, 300});
  return v;
}

struct Step {
  std::vector<float> out, d_x;
  double aux = 0, z = 0;
  std::vector<int64_t> counts;
  std::vector<std::pair<std::string, std::vector<float>>> grads;
};

std::vector<float> Floats(const Tensor& t) {
  std::vector<float> v(t.num_elements());
  for (int64_t i = 0; i < t.num_elements(); ++i) v[i] = t.GetFloat(i);
  return v;
}

absl::StatusOr<Step> RunStep(const EpCase& ec, Backend* backend, Communicator* comm, int64_t begin,
                             int64_t end) {
  const LayerConfig& c = ec.config;
  ASSIGN_OR_RETURN(std::unique_ptr<MoeLayer> layer, MoeLayer::Create(c, backend, comm));
  uint64_t seed = 500;
  for (const std::string& name : layer->ParameterNames()) {
    ASSIGN_OR_RETURN(Tensor t, layer->GetParameter(name));
    if (name == "expert_bias") {  // replicated: the same values on every rank
      t = Tensor::FromFloats(t.shape(), RandomFloats(t.num_elements(), seed, 0.05f));
    }
    if (name == "gate" && ec.hot) {
      for (int64_t h = 0; h < c.hidden; ++h) {
        for (int64_t e = 0; e < c.num_experts / 2; ++e) t.data<float>()[h * c.num_experts + e] += 1;
      }
    }
    RETURN_IF_ERROR(layer->SetParameter(name, t));
  }
  const int64_t H = c.hidden, T = end - begin;
  std::vector<float> xg = RandomFloats(ec.tokens * H, 1), dg = RandomFloats(ec.tokens * H, 2);
  if (ec.hot) {
    for (float& v : xg) v = std::fabs(v);
  }
  std::vector<float> xs(xg.begin() + begin * H, xg.begin() + end * H);
  std::vector<float> ds(dg.begin() + begin * H, dg.begin() + end * H);
  Tensor x = Tensor::FromFloats({T, H}, xs).ConvertTo(c.compute_dtype);
  Tensor d_out = Tensor::FromFloats({T, H}, ds).ConvertTo(c.compute_dtype);
  std::unique_ptr<StepContext> saved;
  ASSIGN_OR_RETURN(ForwardResult fwd, layer->Forward(x, &saved));
  ASSIGN_OR_RETURN(Tensor d_x, layer->Backward(*saved, d_out, 0.7, 1.3));
  Step s;
  s.out = Floats(fwd.out);
  s.d_x = Floats(d_x);
  s.aux = fwd.aux_loss, s.z = fwd.z_loss, s.counts = fwd.tokens_per_expert;
  for (const std::string& name : layer->ParameterNames()) {
    if (name == "expert_bias") continue;
    ASSIGN_OR_RETURN(Tensor g, layer->GetGradient(name));
    s.grads.emplace_back(name, Floats(g));
  }
  return s;
}

absl::Status Compare(const std::string& what, const std::vector<float>& got,
                     const std::vector<float>& want, double tol) {
  const double err = MaxRelError(got, want);
  if (err <= tol) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": relative error ", err, " > ", tol));
}

MOED_WORKER(ep2_gpu, const harness::WorkerContext& ctx) {
  const int rank = ctx.rank;
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, MakeCudaBackend(rank));
  ASSIGN_OR_RETURN(std::shared_ptr<FileKeyValueStore> store,
                   FileKeyValueStore::Create(ctx.store_dir));
  CommOptions options;
  options.timeout = absl::Seconds(60);
  ASSIGN_OR_RETURN(std::unique_ptr<Communicator> ep2,
                   MakeNcclCommunicator(store, "ep2", rank, 2, rank, backend->stream(), options));
  ASSIGN_OR_RETURN(std::unique_ptr<Communicator> ep1,
                   MakeNcclCommunicator(std::make_shared<MemoryKeyValueStore>(), "ep1", 0, 1, rank,
                                        backend->stream(), options));
  std::string report;
  for (const EpCase& ec : Cases()) {
    const LayerConfig& c = ec.config;
    const int64_t begin = rank == 0 ? 0 : ec.rank0_tokens;
    const int64_t end = rank == 0 ? ec.rank0_tokens : ec.tokens;
    ASSIGN_OR_RETURN(Step whole, RunStep(ec, backend.get(), ep1.get(), 0, ec.tokens));
    ASSIGN_OR_RETURN(Step part, RunStep(ec, backend.get(), ep2.get(), begin, end));
    const double tol = c.compute_dtype == DType::kBFloat16 ? 2e-2 : 1e-5;
    const int64_t H = c.hidden;
    auto rows = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + begin * H, v.begin() + end * H);
    };
    const std::string p = ec.name + ": ";
    RETURN_IF_ERROR(Compare(p + "out", part.out, rows(whole.out), tol));
    RETURN_IF_ERROR(Compare(p + "d_x", part.d_x, rows(whole.d_x), tol));
    if (part.counts != whole.counts) return absl::InternalError(p + "tokens_per_expert differ");
    if (std::fabs(part.aux - whole.aux) > 1e-5 * std::max(1.0, std::fabs(whole.aux)) ||
        std::fabs(part.z - whole.z) > 1e-5 * std::max(1.0, std::fabs(whole.z))) {
      return absl::InternalError(absl::StrCat(p, "losses differ: aux ", part.aux, " vs ", whole.aux,
                                              ", z ", part.z, " vs ", whole.z));
    }
    for (size_t i = 0; i < part.grads.size(); ++i) {
      const std::string& name = part.grads[i].first;
      const std::vector<float>& g = part.grads[i].second;
      std::vector<float> want = whole.grads[i].second;
      if (name != "gate") {  // expert tensors: this rank's half of the experts
        const size_t half = want.size() / 2;
        want = std::vector<float>(want.begin() + rank * half, want.begin() + (rank + 1) * half);
      }
      RETURN_IF_ERROR(Compare(p + "gradient of " + name, g, want, tol));
    }
    absl::StrAppend(&report, ec.name, " ok (rank ", rank, ", tokens ", end - begin, ")\n");
  }
  return harness::WriteResult(ctx, "report", report);
}

TEST(Ep2Gpu, MatchesEp1) {
  if (CudaDeviceCount() < 2) {
    if (std::getenv("MOED_REQUIRE_GPU") != nullptr) FAIL() << "fewer than 2 GPUs";
    GTEST_SKIP() << "needs 2 GPUs";
  }
  harness::LaunchOptions launch;
  launch.worker = "ep2_gpu";
  launch.size = 2;
  launch.deadline = absl::Seconds(240);
  auto run = harness::RunWorkers(launch);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(run->AllSucceeded()) << run->Summary();
  for (const harness::RankResult& r : run->ranks) {
    auto report = harness::ReadResult(r, "report");
    ASSERT_TRUE(report.ok()) << report.status();
    std::cout << *report;
  }
}

}  // namespace
}  // namespace gpu_test
}  // namespace moe
