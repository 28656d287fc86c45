// MoeServiceImpl: gradients and weights (GetGradients, GetWeights, SetWeights, ZeroGradients).
//
// Whole-layer tensors <-> worker shards: an expert-sharded tensor ([E, ...]) is the
// concatenation along its first dimension of the workers' [El, ...] shards in rank order
// (row-major, so the bytes simply concatenate); a replicated one (gate, expert_bias) is read
// from rank 0 and written to every rank.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "proto/chunking.h"
#include "proto/config_convert.h"
#include "proto/layer_info.h"
#include "proto/status_convert.h"
#include "server/moe_service.h"

namespace moe {
namespace {

std::map<std::string, ParameterLayout> LayoutByName(const LayerConfig& config) {
  std::map<std::string, ParameterLayout> out;
  for (ParameterLayout& p : LayerParameters(config)) out[p.name] = p;
  return out;
}

// Bytes of a whole-layer fp32 parameter (ValidateConfig's bounds keep it far from overflow).
int64_t Fp32Bytes(const ParameterLayout& p) {
  return NumElements(p.shape) * static_cast<int64_t>(sizeof(float));
}

std::vector<int64_t> ShardShape(const ParameterLayout& p, int ranks) {
  std::vector<int64_t> shape = p.shape;
  if (p.expert_sharded) shape[0] /= ranks;
  return shape;
}

}  // namespace

absl::Status MoeServiceImpl::HoldStreamBytes(int64_t bytes, int64_t* held) {
  absl::MutexLock lock(&stream_mu_);
  const int64_t others = stream_bytes_ - *held;
  if (others > 0 && stream_bytes_ + bytes > options_.max_stream_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "other open weight streams (GetWeights, GetGradients, SetWeights) hold ", others,
        " bytes of whole-layer tensors in moed and this one needs ", *held + bytes,
        ", past --max_stream_bytes=", options_.max_stream_bytes,
        "; finish or cancel the open streams, or send or ask for fewer tensors at once"));
  }
  stream_bytes_ += bytes;
  *held += bytes;
  return absl::OkStatus();
}

void MoeServiceImpl::ReleaseStreamBytes(int64_t held) {
  absl::MutexLock lock(&stream_mu_);
  stream_bytes_ -= held;
}

absl::Status MoeServiceImpl::ResolveNames(
    const Layer& layer, bool gradients,
    const google::protobuf::RepeatedPtrField<std::string>& requested,
    std::vector<std::string>* names) const {
  const std::vector<ParameterLayout> params = LayerParameters(layer.config);
  if (requested.empty()) {
    for (const ParameterLayout& p : params) {
      if (!gradients || p.has_gradient) names->push_back(p.name);
    }
    return absl::OkStatus();
  }
  const auto by_name = LayoutByName(layer.config);
  for (const std::string& name : requested) {
    if (std::find(names->begin(), names->end(), name) != names->end()) {
      return absl::InvalidArgumentError(absl::StrCat("names: \"", name, "\" appears twice"));
    }
    auto it = by_name.find(name);
    if (it == by_name.end() || (gradients && !it->second.has_gradient)) {
      return absl::InvalidArgumentError(absl::StrCat("names: \"", name, "\" is not a ",
                                                     gradients ? "gradient" : "parameter",
                                                     " of layer \"", layer.name, "\""));
    }
    names->push_back(name);
  }
  return absl::OkStatus();
}

absl::Status MoeServiceImpl::GatherTensors(const WorkerSet& set, const Layer& layer, bool gradients,
                                           const std::vector<std::string>& names,
                                           grpc::ServerContextBase* context,
                                           std::vector<NamedTensor>* out) {
  const auto by_name = LayoutByName(layer.config);
  const int ranks = set.size();
  std::vector<std::vector<NamedTensor>> shards(ranks);
  // Reads only: the client's deadline and cancellation stop the workers' streams (their next
  // chunk write fails).
  FanOutOptions options;
  options.cancelled = [context] { return context->IsCancelled(); };
  FanOutOutcome outcome;
  RETURN_IF_ERROR(pool_->ForEachWorker(
      set, InternalDeadline(context, false),
      [&](int r, internal::Worker::Stub* stub, grpc::ClientContext* ctx) -> absl::Status {
        internal::WorkerGetTensorsRequest call;
        call.set_generation(set.generation);
        call.set_layer_id(layer.id);
        call.set_kind(gradients ? internal::TENSOR_KIND_GRADIENT : internal::TENSOR_KIND_PARAMETER);
        std::map<std::string, ExpectedTensor> expected;
        for (const std::string& name : names) {
          const ParameterLayout& p = by_name.at(name);
          if (!p.expert_sharded && r != 0) continue;
          call.add_names(name);
          expected[name] = ExpectedTensor{DType::kFloat32, ShardShape(p, ranks)};
        }
        if (call.names().empty()) return absl::OkStatus();
        ChunkAssembler assembler(std::move(expected));
        auto reader = stub->GetTensors(ctx, call);
        v1::TensorChunk chunk;
        absl::Status added;
        while (reader->Read(&chunk)) {
          if (added.ok()) added = assembler.Add(chunk);
        }
        RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
        if (!added.ok()) return absl::InternalError(added.message());
        ASSIGN_OR_RETURN(shards[r], assembler.Finish());
        return absl::OkStatus();
      },
      options, &outcome));
  for (const std::string& name : names) {
    const ParameterLayout& p = by_name.at(name);
    Tensor whole = Tensor::Zeros(DType::kFloat32, p.shape);
    size_t offset = 0;
    for (int r = 0; r < (p.expert_sharded ? ranks : 1); ++r) {
      for (const auto& named : shards[r]) {
        if (named.name != name) continue;
        std::memcpy(static_cast<char*>(whole.raw()) + offset, named.tensor.raw(),
                    named.tensor.num_bytes());
        offset += named.tensor.num_bytes();
      }
    }
    if (offset != whole.num_bytes()) {
      return absl::InternalError(absl::StrCat("workers returned ", offset, " bytes of \"", name,
                                              "\", expected ", whole.num_bytes()));
    }
    out->push_back({name, std::move(whole)});
  }
  return absl::OkStatus();
}

namespace {

// Streams gathered tensors to the client in chunks that fit the message limit.
absl::Status StreamTensors(const std::vector<NamedTensor>& tensors, int64_t max_chunk_bytes,
                           int64_t max_message_bytes, StreamWriter<v1::TensorChunk>* writer) {
  if (max_chunk_bytes < 0) return absl::InvalidArgumentError("max_chunk_bytes: must be >= 0");
  if (max_chunk_bytes == 0) max_chunk_bytes = kDefaultChunkBytes;
  // Room for the chunk's name and shape next to the raw bytes.
  max_chunk_bytes = std::min<int64_t>(max_chunk_bytes, max_message_bytes - 4096);
  for (const auto& named : tensors) {
    RETURN_IF_ERROR(
        ChunkTensor(named.name, named.tensor, max_chunk_bytes, [&](const v1::TensorChunk& chunk) {
          return writer->Write(chunk) ? absl::OkStatus()
                                      : absl::CancelledError("client stopped reading");
        }));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeServiceImpl::ServeTensors(
    grpc::ServerContextBase* context, const std::string& layer, bool gradients,
    const google::protobuf::RepeatedPtrField<std::string>& requested, int64_t max_chunk_bytes,
    StreamWriter<v1::TensorChunk>* writer) {
  // A client that stops reading is cancelled instead of holding the gathered copy for good.
  writer->CancelIfIdle(options_.stream_idle_timeout, context);
  ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(layer));
  std::vector<std::string> names;
  RETURN_IF_ERROR(ResolveNames(*found, gradients, requested, &names));
  if (max_chunk_bytes < 0) return absl::InvalidArgumentError("max_chunk_bytes: must be >= 0");
  // The gathered copy lives until the client has read it: reserve its bytes first.
  const auto by_name = LayoutByName(found->config);
  int64_t bytes = 0;
  for (const std::string& name : names) bytes += Fp32Bytes(by_name.at(name));
  int64_t held = 0;
  absl::Cleanup release = [this, &held] { ReleaseStreamBytes(held); };
  RETURN_IF_ERROR(HoldStreamBytes(bytes, &held));
  std::vector<NamedTensor> tensors;
  {
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn, TakeTurn(found, context));
    RETURN_IF_ERROR(GatherTensors(turn->set, turn->layer(), gradients, names, context, &tensors));
  }
  return StreamTensors(tensors, max_chunk_bytes, options_.max_message_bytes, writer);
}

grpc::Status MoeServiceImpl::DoGetGradients(grpc::ServerContextBase* context,
                                            const v1::GetGradientsRequest* request,
                                            StreamWriter<v1::TensorChunk>* writer) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "GetGradients");
  return Finish("GetGradients", start,
                ServeTensors(context, request->layer(), /*gradients=*/true, request->names(),
                             request->max_chunk_bytes(), writer));
}

grpc::Status MoeServiceImpl::DoGetWeights(grpc::ServerContextBase* context,
                                          const v1::GetWeightsRequest* request,
                                          StreamWriter<v1::TensorChunk>* writer) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "GetWeights");
  return Finish("GetWeights", start,
                ServeTensors(context, request->layer(), /*gradients=*/false, request->names(),
                             request->max_chunk_bytes(), writer));
}

namespace {

// Every parameter of the layer, whole: what a SetWeights stream may send. *bytes_of gets each
// one's size.
std::unique_ptr<ChunkAssembler> WholeLayerAssembler(const LayerConfig& config,
                                                    std::map<std::string, int64_t>* bytes_of) {
  std::map<std::string, ExpectedTensor> expected;
  for (const ParameterLayout& p : LayerParameters(config)) {
    expected[p.name] = ExpectedTensor{DType::kFloat32, p.shape};
    (*bytes_of)[p.name] = Fp32Bytes(p);
  }
  return std::make_unique<ChunkAssembler>(std::move(expected));
}

absl::Status CheckFinite(const std::vector<NamedTensor>& tensors) {
  for (const auto& named : tensors) {
    for (int64_t i = 0; i < named.tensor.num_elements(); ++i) {
      if (!std::isfinite(named.tensor.data<float>()[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("chunk \"", named.name, "\": element ", i, " is not finite"));
      }
    }
  }
  return absl::OkStatus();
}

// Worker r's shards of `tensors` (its rows of an expert-sharded tensor, all of a replicated
// one) in chunks on one SetTensors stream, each call a copy of `head` (generation, layer,
// stage) with its chunk.
absl::Status SendShards(internal::Worker::Stub* stub, grpc::ClientContext* ctx,
                        const internal::WorkerSetTensorsRequest& head,
                        const std::vector<NamedTensor>& tensors,
                        const std::map<std::string, ParameterLayout>& by_name, int r, int ranks) {
  internal::WorkerEmpty empty;
  auto writer = stub->SetTensors(ctx, &empty);
  absl::Status written;
  for (const auto& named : tensors) {
    const ParameterLayout& p = by_name.at(named.name);
    Tensor shard = named.tensor;
    if (p.expert_sharded) {
      const int64_t per = p.shape[0] / ranks;
      shard = named.tensor.SliceRows(r * per, (r + 1) * per);
    }
    written = ChunkTensor(named.name, shard, kDefaultChunkBytes, [&](v1::TensorChunk&& chunk) {
      internal::WorkerSetTensorsRequest call = head;
      *call.mutable_chunk() = std::move(chunk);
      return writer->Write(call) ? absl::OkStatus()
                                 : absl::UnavailableError("worker stream closed");
    });
    if (!written.ok()) break;
  }
  writer->WritesDone();
  absl::Status finished = FromGrpcStatus(writer->Finish());
  return finished.ok() ? written : finished;
}

}  // namespace

absl::StatusOr<std::vector<NamedTensor>> MoeServiceImpl::ReadWeightsStream(
    StreamReader<v1::SetWeightsRequest>* reader, std::shared_ptr<Layer>* layer, int64_t* held) {
  v1::SetWeightsRequest message;
  std::string name;
  std::unique_ptr<ChunkAssembler> assembler;
  std::map<std::string, int64_t> bytes_of;  // expected tensors' sizes
  absl::Status invalid;
  while (reader->Read(&message)) {
    if (!invalid.ok()) continue;  // drain the stream, keep the first error
    if (*layer == nullptr) {
      absl::StatusOr<std::shared_ptr<Layer>> found = FindLayer(message.layer());
      if (!found.ok()) {
        invalid = found.status();
        continue;
      }
      *layer = *found;
      name = message.layer();
      assembler = WholeLayerAssembler((*layer)->config, &bytes_of);
    } else if (!message.layer().empty() && message.layer() != name) {
      invalid = absl::InvalidArgumentError(absl::StrCat(
          "layer: \"", message.layer(), "\" differs from the stream's first \"", name, "\""));
      continue;
    }
    if (!message.has_chunk()) {
      invalid = absl::InvalidArgumentError("chunk: required");
      continue;
    }
    // A tensor's memory is held from its first chunk on (the assembler allocates it then).
    auto size = bytes_of.find(message.chunk().name());
    if (size != bytes_of.end()) {
      invalid = HoldStreamBytes(size->second, held);
      bytes_of.erase(size);
      if (!invalid.ok()) continue;
    }
    invalid = assembler->Add(message.chunk());
  }
  RETURN_IF_ERROR(invalid);
  if (*layer == nullptr) return absl::InvalidArgumentError("layer: empty stream");
  ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, assembler->Finish());
  RETURN_IF_ERROR(CheckFinite(tensors));
  return tensors;
}

bool MoeServiceImpl::RepairsDiverged(Layer& layer, const std::vector<NamedTensor>& tensors) {
  {
    absl::MutexLock lock(&layer.mu);
    if (layer.diverged.empty()) return false;
  }
  std::set<std::string> set;
  for (const NamedTensor& named : tensors) set.insert(named.name);
  for (const ParameterLayout& p : LayerParameters(layer.config)) {
    if (set.count(p.name) == 0) return false;
  }
  return true;
}

absl::Status MoeServiceImpl::StageWeights(Turn& turn, grpc::ServerContextBase* context,
                                          uint64_t stage_id,
                                          const std::vector<NamedTensor>& tensors) {
  const auto by_name = LayoutByName(turn.layer().config);
  const int ranks = turn.set.size();
  internal::WorkerSetTensorsRequest head;
  head.set_generation(turn.set.generation);
  head.set_layer_id(turn.layer().id);
  head.set_stage_id(stage_id);
  return FanOutOnLayer(
      turn, InternalDeadline(context, false),
      [&](int r, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
        return SendShards(stub, ctx, head, tensors, by_name, r, ranks);
      },
      /*collective=*/false);
}

grpc::Status MoeServiceImpl::DoSetWeights(grpc::ServerContextBase* context,
                                          StreamReader<v1::SetWeightsRequest>* reader,
                                          v1::SetWeightsResponse* response) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "SetWeights");
  // A client that stops sending is cancelled instead of holding what was assembled for good.
  reader->CancelIfIdle(options_.stream_idle_timeout, context);
  auto run = [&]() -> absl::Status {
    // Read and validate the whole stream before any worker sees it.
    std::shared_ptr<Layer> layer;
    int64_t held = 0;  // of max_stream_bytes, for the tensors begun so far
    absl::Cleanup release = [this, &held] { ReleaseStreamBytes(held); };
    ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, ReadWeightsStream(reader, &layer, &held));

    // Allowed on a diverged layer: the tensors it sets agree afterwards (the rest may not).
    // One that sets every parameter repairs it: the workers also drop their optimizer state
    // and gradients (which may differ too), and the layer is no longer diverged.
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn,
                     TakeTurn(layer, context, /*require_serving=*/true, /*allow_diverged=*/true));
    const bool repair = RepairsDiverged(turn->layer(), tensors);
    // Two phases: every worker receives and checks its shards and keeps them staged (changes
    // nothing); only when all did does any apply them (CommitStage). A stream that breaks, a
    // worker that stops answering or the client's deadline therefore leave the layer as it
    // was, not diverged.
    const uint64_t stage_id = next_step_id_++;
    absl::Status staged = StageWeights(*turn, context, stage_id, tensors);
    if (!staged.ok()) {
      AbortStage(*turn, stage_id, staged);
      return staged;
    }
    RETURN_IF_ERROR(CommitStage(*turn, "SetWeights", stage_id, /*reset_optimizer=*/repair));
    if (repair) {
      absl::MutexLock lock(&turn->layer().mu);
      turn->layer().ClearDiverged();
      turn->layer().gradients_dropped = false;
      std::fprintf(stderr, "moed: layer %s repaired by SetWeights (optimizer state reset)\n",
                   turn->layer().name.c_str());
    }
    AfterChange(*turn, /*optimizer_step=*/false, /*force=*/true);  // durable before the answer
    for (const auto& named : tensors) response->add_updated(named.name);
    return absl::OkStatus();
  };
  return Finish("SetWeights", start, run());
}

grpc::Status MoeServiceImpl::DoZeroGradients(grpc::ServerContextBase* context,
                                             const v1::ZeroGradientsRequest* request,
                                             v1::ZeroGradientsResponse*) {
  const absl::Time start = absl::Now();
  const InflightRequest inflight(metrics_, "ZeroGradients");
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn,
                     TakeTurn(request->layer(), context, /*require_serving=*/true,
                              /*allow_diverged=*/true));
    internal::WorkerLayerRequest call;
    call.set_generation(turn->set.generation);
    call.set_layer_id(turn->layer().id);
    RETURN_IF_ERROR(ChangeOnWorkers(
        *turn, "ZeroGradients", InternalDeadline(context, false),
        [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
          internal::WorkerEmpty empty;
          return FromGrpcStatus(stub->ZeroGradients(ctx, call, &empty));
        },
        /*collective=*/false, /*gradients_only=*/true));
    absl::MutexLock lock(&turn->layer().mu);
    if (turn->layer().diverged_gradients_only) turn->layer().ClearDiverged();
    turn->layer().gradients_dropped = false;
    return absl::OkStatus();
  };
  return Finish("ZeroGradients", start, run());
}

}  // namespace moe
