// Layer checkpoints: one file per expert, so the EP layout may change between save and load.
#include "engine/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "engine/checkpoint_file.h"
#include "engine/config.h"
#include "engine/file_util.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

constexpr char kConfigFile[] = "config.txt";
constexpr char kRouterFile[] = "router.bin";
constexpr char kCompleteFile[] = "COMPLETE";
constexpr char kCompleteText[] = "moed layer checkpoint v1\n";
constexpr char kStep[] = "step";

std::string Join(const std::string& dir, absl::string_view file) {
  return absl::StrCat(dir, "/", file);
}

// "wi.m" -> "wi"; "gate" -> "gate".
std::string BaseName(const std::string& name) { return name.substr(0, name.find('.')); }

bool IsExpertTensor(const std::string& base) {
  return base == "wi" || base == "wo" || base == "wi_bias" || base == "wo_bias";
}

// The expert parameters a config has, in file order.
std::vector<std::string> ExpertParams(const LayerConfig& c) {
  std::vector<std::string> names = {"wi", "wo"};
  if (c.use_bias) names.insert(names.end(), {"wi_bias", "wo_bias"});
  return names;
}

// This rank's delayed-scaling histories (engine/fp8_history.h): per rank, since each rank
// scales the rows it holds; loaded only by the same rank of the same number of ranks.
std::string Fp8HistoryFileName(int64_t rank, int64_t ranks) {
  return absl::StrFormat("fp8_rank_%05d_of_%05d.bin", rank, ranks);
}

bool IsFp8HistoryTensor(const std::string& name) { return BaseName(name) == "fp8"; }

// Shape of a parameter (or its state) for one expert, or of a whole router tensor.
std::vector<int64_t> ParamShape(const LayerConfig& c, const std::string& base) {
  if (base == "gate") return {c.hidden, c.num_experts};
  if (base == "expert_bias") return {c.num_experts};
  if (base == "wi") return {c.hidden, UpWidth(c)};
  if (base == "wo") return {c.ffn, c.hidden};
  if (base == "wi_bias") return {UpWidth(c)};
  if (base == "wo_bias") return {c.hidden};
  return {1};  // "step"
}

// Sums one value over the ranks; a barrier as well. Uses backend memory so that it works for
// every communicator (host or device).
absl::StatusOr<int64_t> SumOverRanks(const MoeLayer& layer, int64_t value) {
  Backend* backend = layer.backend();
  ASSIGN_OR_RETURN(Buffer buffer, backend->Allocate(sizeof(value)));
  RETURN_IF_ERROR(backend->CopyFromHost(buffer.data(), &value, sizeof(value)));
  RETURN_IF_ERROR(layer.communicator()->AllReduceSum(buffer.data(), 1, DType::kInt64));
  RETURN_IF_ERROR(backend->CopyToHost(&value, buffer.data(), sizeof(value)));
  return value;
}

// Every rank learns whether every rank succeeded: a failing rank returns its own error, the
// others ABORTED.
absl::Status AgreeAcrossRanks(const MoeLayer& layer, const absl::Status& local,
                              absl::string_view what) {
  absl::StatusOr<int64_t> failures = SumOverRanks(layer, local.ok() ? 0 : 1);
  if (!local.ok()) return local;
  if (!failures.ok()) return failures.status();
  if (*failures > 0) {
    return absl::AbortedError(absl::StrCat(what, " failed on ", *failures, " other rank(s)"));
  }
  return absl::OkStatus();
}

// Row i of a [El, ...] tensor as a tensor of the remaining dimensions.
absl::StatusOr<Tensor> Row(const Tensor& local, int64_t i) {
  std::vector<int64_t> shape(local.shape().begin() + 1, local.shape().end());
  const size_t row_bytes = local.num_bytes() / local.dim(0);
  return Tensor::FromBytes(local.dtype(), shape, local.bytes().substr(i * row_bytes, row_bytes));
}

absl::Status WriteRankFiles(const MoeLayer& layer, const std::string& dir) {
  const LayerConfig& config = layer.config();
  // Router tensors (rank 0) and this rank's expert tensors, by name.
  std::vector<NamedTensor> router, fp8_history;
  std::vector<std::pair<std::string, Tensor>> expert_tensors;
  for (const std::string& name : layer.ParameterNames()) {
    ASSIGN_OR_RETURN(Tensor t, layer.GetParameter(name));
    if (IsExpertTensor(name)) {
      expert_tensors.emplace_back(name, std::move(t));
    } else {
      router.push_back({name, std::move(t)});
    }
  }
  for (const std::string& name : layer.StateNames()) {
    const std::string base = BaseName(name);
    ASSIGN_OR_RETURN(Tensor t, layer.GetState(name));
    if (IsExpertTensor(base)) {
      expert_tensors.emplace_back(name, std::move(t));
    } else if (IsFp8HistoryTensor(name)) {
      fp8_history.push_back({name, std::move(t)});
    } else if (name == kStep || base == "gate" || base == "expert_bias") {
      router.push_back({name, std::move(t)});
    } else {
      return absl::UnimplementedError(
          absl::StrCat("checkpoint: optimizer state '", name, "' has no place in the format"));
    }
  }
  if (layer.communicator()->rank() == 0) {
    const std::string text = ConfigToString(config) + "\n";
    RETURN_IF_ERROR(WriteFileAtomically(Join(dir, kConfigFile), {text}));
    RETURN_IF_ERROR(WriteTensorFile(Join(dir, kRouterFile), router));
  }
  if (!fp8_history.empty()) {
    const Communicator& comm = *layer.communicator();
    RETURN_IF_ERROR(
        WriteTensorFile(Join(dir, Fp8HistoryFileName(comm.rank(), comm.size())), fp8_history));
  }
  for (int64_t i = 0; i < layer.local_experts(); ++i) {
    std::vector<NamedTensor> tensors;
    for (const auto& [name, local] : expert_tensors) {
      ASSIGN_OR_RETURN(Tensor row, Row(local, i));
      tensors.push_back({name, std::move(row)});
    }
    RETURN_IF_ERROR(WriteTensorFile(Join(dir, ExpertFileName(layer.first_expert() + i)), tensors));
  }
  return absl::OkStatus();
}

// Removes a stale COMPLETE so that it never vouches for a half-rewritten directory.
absl::Status PrepareDirectory(const MoeLayer& layer, const std::string& dir) {
  RETURN_IF_ERROR(MakeDirectories(dir));
  if (layer.communicator()->rank() != 0) return absl::OkStatus();
  const std::string complete = Join(dir, kCompleteFile);
  if (::unlink(complete.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, absl::StrCat("remove ", complete));
  }
  return absl::OkStatus();
}

// Checks the tensors of one file against the expected names and shapes: `required` params
// must all be there, each with the states "<param>.<suffix>" for exactly `suffixes`;
// `stateless` params must be there without state; "step" may be there where `allow_step`.
absl::Status VerifyFileTensors(const std::string& path, const LayerConfig& config,
                               const std::vector<NamedTensor>& tensors,
                               const std::vector<std::string>& required,
                               const std::vector<std::string>& stateless,
                               const std::set<std::string>& suffixes, bool allow_step) {
  std::set<std::string> seen;
  for (const NamedTensor& nt : tensors) {
    const std::string base = BaseName(nt.name);
    const bool is_param = std::find(required.begin(), required.end(), nt.name) != required.end() ||
                          std::find(stateless.begin(), stateless.end(), nt.name) != stateless.end();
    const bool is_state = nt.name.size() > base.size() &&
                          std::find(required.begin(), required.end(), base) != required.end() &&
                          suffixes.count(nt.name.substr(base.size() + 1)) > 0;
    const bool is_step = allow_step && nt.name == kStep;
    if (!is_param && !is_state && !is_step) {
      return absl::DataLossError(absl::StrCat("checkpoint file ", path, ": unexpected tensor '",
                                              nt.name, "' for config ", ConfigToString(config)));
    }
    const std::vector<int64_t> expected = ParamShape(config, is_step ? kStep : base);
    if (nt.tensor.dtype() != DType::kFloat32 || nt.tensor.shape() != expected) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint file ", path, ": tensor ", nt.name, " is ", DTypeName(nt.tensor.dtype()),
          nt.tensor.ShapeString(), ", expected FP32[", absl::StrJoin(expected, ", "), "]"));
    }
    seen.insert(nt.name);
  }
  for (const std::string& name : required) {
    std::vector<std::string> wanted = {name};
    for (const std::string& s : suffixes) wanted.push_back(absl::StrCat(name, ".", s));
    for (const std::string& w : wanted) {
      if (seen.count(w) == 0) {
        return absl::DataLossError(
            absl::StrCat("checkpoint file ", path, ": tensor '", w, "' is missing"));
      }
    }
  }
  for (const std::string& name : stateless) {
    if (seen.count(name) == 0) {
      return absl::DataLossError(
          absl::StrCat("checkpoint file ", path, ": tensor '", name, "' is missing"));
    }
  }
  return absl::OkStatus();
}

// The delayed-scaling histories of the rank that holds experts [first_expert, +local), when
// the layer has them and the checkpoint has that rank's file (saved by the same rank of as
// many ranks) with a history of the layer's length; else nothing (the history starts empty,
// as for checkpoints written before FP8 had one). A file that is there must be sound.
absl::Status ReadFp8History(const LayerConfig& config, const std::string& dir, int64_t first_expert,
                            int64_t local, StagedCheckpoint& out) {
  if (config.compute_dtype != DType::kFloat8E4M3 || config.fp8_recipe != Fp8Recipe::kDelayed ||
      local <= 0) {
    return absl::OkStatus();
  }
  const std::string path =
      Join(dir, Fp8HistoryFileName(first_expert / local, config.num_experts / local));
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, ReadTensorFile(path));
  std::map<std::string, Tensor> history;
  for (NamedTensor& nt : tensors) {
    if (!IsFp8HistoryTensor(nt.name) || nt.tensor.dtype() != DType::kFloat32) {
      return absl::DataLossError(absl::StrCat("checkpoint file ", path, ": unexpected tensor '",
                                              nt.name, "' ", DTypeName(nt.tensor.dtype())));
    }
    history[nt.name] = std::move(nt.tensor);
  }
  auto it = history.find("fp8.amax_history");
  if (history.size() != 2 || it == history.end() || history.count("fp8.amax_steps") == 0) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", path, ": want fp8.amax_history and fp8.amax_steps"));
  }
  if (it->second.shape() != std::vector<int64_t>{4, config.fp8_amax_history_len}) {
    return absl::OkStatus();  // another fp8_amax_history_len: not this layer's history
  }
  for (auto& [name, tensor] : history) out.states[name] = std::move(tensor);
  return absl::OkStatus();
}

// Reads and verifies the checkpoint in `dir` for `config`: COMPLETE, config, router and the
// experts [first_expert, first_expert + local). With `keep`, returns the tensors (expert
// tensors stacked [local, ...]); without, only verifies, holding one file at a time.
absl::StatusOr<StagedCheckpoint> ReadCheckpoint(const LayerConfig& config, const std::string& dir,
                                                int64_t first_expert, int64_t local, bool keep) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  absl::StatusOr<std::string> complete = ReadWholeFile(Join(dir, kCompleteFile));
  if (absl::IsNotFound(complete.status())) {
    return absl::DataLossError(absl::StrCat("checkpoint ", dir, " has no ", kCompleteFile,
                                            " marker: its save did not finish"));
  }
  RETURN_IF_ERROR(complete.status());
  if (*complete != kCompleteText) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", Join(dir, kCompleteFile), ": unexpected contents"));
  }

  const std::string config_path = Join(dir, kConfigFile);
  ASSIGN_OR_RETURN(std::string config_text, ReadWholeFile(config_path));
  if (!config_text.empty() && config_text.back() == '\n') config_text.pop_back();
  absl::StatusOr<LayerConfig> saved = ConfigFromString(config_text);
  if (!saved.ok()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", config_path, ": ", saved.status().message()));
  }
  LayerConfig comparable = *saved;
  comparable.init_seed = config.init_seed;
  comparable.compute_dtype = config.compute_dtype;
  // The FP8 knobs are how the layer computes, like compute_dtype: any of them loads.
  comparable.fp8_recipe = config.fp8_recipe;
  comparable.fp8_amax_history_len = config.fp8_amax_history_len;
  comparable.fp8_margin = config.fp8_margin;
  comparable.fp8_amax_compute_algo = config.fp8_amax_compute_algo;
  comparable.fp8_gemms = config.fp8_gemms;
  if (ConfigToString(comparable) != ConfigToString(config)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", dir, " holds a layer with config {", ConfigToString(*saved),
                     "}, but this layer has {", ConfigToString(config), "}"));
  }

  StagedCheckpoint out;
  const std::string router_path = Join(dir, kRouterFile);
  ASSIGN_OR_RETURN(std::vector<NamedTensor> router, ReadTensorFile(router_path));
  std::set<std::string> suffixes;  // optimizer state kinds, as the router file has them
  for (const NamedTensor& nt : router) {
    if (BaseName(nt.name) == "gate" && nt.name != "gate") suffixes.insert(nt.name.substr(5));
  }
  for (const std::string& s : suffixes) {
    if (s != "m" && s != "v") {
      return absl::DataLossError(
          absl::StrCat("checkpoint file ", router_path, ": unexpected tensor gate.", s));
    }
  }
  // expert_bias has no gradient, hence no optimizer state.
  std::vector<std::string> stateless;
  if (config.use_expert_bias) stateless.push_back("expert_bias");
  RETURN_IF_ERROR(
      VerifyFileTensors(router_path, config, router, {"gate"}, stateless, suffixes, true));
  for (const NamedTensor& nt : router) {
    if (!keep) break;
    (nt.name == "gate" || nt.name == "expert_bias" ? out.params : out.states)[nt.name] = nt.tensor;
  }

  const std::vector<std::string> expert_params = ExpertParams(config);
  for (int64_t i = 0; i < local; ++i) {
    const std::string path = Join(dir, ExpertFileName(first_expert + i));
    ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, ReadTensorFile(path));
    RETURN_IF_ERROR(VerifyFileTensors(path, config, tensors, expert_params, {}, suffixes, false));
    if (!keep) continue;
    for (const NamedTensor& nt : tensors) {
      auto& target = (nt.name.find('.') == std::string::npos ? out.params : out.states);
      auto it = target.find(nt.name);
      if (it == target.end()) {
        std::vector<int64_t> shape = {local};
        shape.insert(shape.end(), nt.tensor.shape().begin(), nt.tensor.shape().end());
        it = target.emplace(nt.name, Tensor::Zeros(DType::kFloat32, shape)).first;
      }
      std::memcpy(static_cast<uint8_t*>(it->second.raw()) + i * nt.tensor.num_bytes(),
                  nt.tensor.raw(), nt.tensor.num_bytes());
    }
  }
  if (keep) RETURN_IF_ERROR(ReadFp8History(config, dir, first_expert, local, out));
  return out;
}

}  // namespace

absl::StatusOr<StagedCheckpoint> StageCheckpoint(const MoeLayer& layer, const std::string& dir) {
  return ReadCheckpoint(layer.config(), dir, layer.first_expert(), layer.local_experts(),
                        /*keep=*/true);
}

absl::Status VerifyCheckpoint(const LayerConfig& config, const std::string& dir) {
  return ReadCheckpoint(config, dir, 0, config.num_experts, /*keep=*/false).status();
}

std::string ExpertFileName(int64_t expert) { return absl::StrFormat("expert_%05d.bin", expert); }

absl::Status SaveCheckpoint(const MoeLayer& layer, const std::string& dir) {
  RETURN_IF_ERROR(
      AgreeAcrossRanks(layer, PrepareDirectory(layer, dir), "preparing checkpoint directory"));
  RETURN_IF_ERROR(AgreeAcrossRanks(layer, WriteRankFiles(layer, dir), "writing checkpoint files"));
  absl::Status complete = absl::OkStatus();
  if (layer.communicator()->rank() == 0) {
    complete = WriteFileAtomically(Join(dir, kCompleteFile), {kCompleteText});
  }
  return AgreeAcrossRanks(layer, complete, "writing the checkpoint's COMPLETE marker");
}

absl::Status LoadCheckpoint(MoeLayer* layer, const std::string& dir) {
  absl::StatusOr<StagedCheckpoint> ckpt = StageCheckpoint(*layer, dir);
  RETURN_IF_ERROR(
      AgreeAcrossRanks(*layer, ckpt.status(), absl::StrCat("verifying checkpoint ", dir)));
  // Everything is verified on every rank: install it.
  return InstallCheckpoint(layer, *ckpt);
}

absl::Status InstallCheckpoint(MoeLayer* layer, const StagedCheckpoint& staged) {
  for (const auto& [name, value] : staged.params) {
    RETURN_IF_ERROR(layer->SetParameter(name, value));
  }
  for (const std::string& name : layer->StateNames()) {
    if (staged.states.count(name) > 0) continue;
    ASSIGN_OR_RETURN(Tensor current, layer->GetState(name));
    RETURN_IF_ERROR(layer->SetState(name, Tensor::Zeros(DType::kFloat32, current.shape())));
  }
  for (const auto& [name, value] : staged.states) {
    RETURN_IF_ERROR(layer->SetState(name, value));
  }
  return absl::OkStatus();
}

}  // namespace moe
