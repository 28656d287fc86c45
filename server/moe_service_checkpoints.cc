// MoeServiceImpl: checkpoints on the server's disk. The workers write (and read) the files of
// their own experts (engine/checkpoint.h); the front end makes a save atomic by renaming a
// fresh sibling directory over the target once every worker succeeded.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "server/moe_service.h"
#include "server/status_convert.h"

namespace moe {
namespace {

// Removes a directory tree (checkpoint directories hold only plain files).
void RemoveTree(const std::string& path) {
  std::error_code error;
  std::filesystem::remove_all(path, error);
  if (error)
    std::fprintf(stderr, "moed: could not remove %s: %s\n", path.c_str(), error.message().c_str());
}

absl::Status CheckDirectory(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("directory: required");
  if (dir[0] != '/') return absl::InvalidArgumentError("directory: must be an absolute path");
  if (dir.find('\'') != std::string::npos || dir.find("/../") != std::string::npos) {
    return absl::InvalidArgumentError("directory: must not contain ' or /../");
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status MoeServiceImpl::DoSaveCheckpoint(grpc::ServerContextBase* context,
                                              const v1::SaveCheckpointRequest* request,
                                              v1::SaveCheckpointResponse* response) {
  const absl::Time start = absl::Now();
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request->layer()));
    std::string dir = request->directory();
    RETURN_IF_ERROR(CheckDirectory(dir));
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    // The checkpoint replaces `dir` by rename: "/", "." and ".." cannot be renamed (and the
    // workers would first write a sibling of them).
    const std::string last = dir.substr(dir.rfind('/') + 1);
    if (last.empty() || last == "." || last == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          "directory: \"", request->directory(),
          "\" does not name a directory that can be replaced (last component \"", last, "\")"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn, TakeTurn(found, context));
    // Atomic: the workers write a fresh sibling directory; it replaces `dir` by rename only
    // once every worker succeeded (the old checkpoint is removed after the rename).
    const std::string suffix = absl::StrCat(getpid(), ".", next_step_id_++);
    const std::string tmp = absl::StrCat(dir, ".tmp.", suffix);
    internal::WorkerCheckpointRequest call;
    call.set_generation(turn->set.generation);
    call.set_layer_id(turn->layer().id);
    call.set_directory(tmp);
    absl::Status saved = pool_->ForEachWorker(
        turn->set, InternalDeadline(context, true),
        [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
          internal::WorkerEmpty empty;
          return FromGrpcStatus(stub->SaveCheckpoint(ctx, call, &empty));
        },
        /*collective=*/true);
    if (!saved.ok()) {
      RemoveTree(tmp);
      return saved;
    }
    const std::string old = absl::StrCat(dir, ".old.", suffix);
    struct stat st;
    const bool existed = stat(dir.c_str(), &st) == 0;
    if (existed && rename(dir.c_str(), old.c_str()) != 0) {
      RemoveTree(tmp);
      return absl::InternalError(
          absl::StrCat("directory: cannot move the old ", dir, ": ", strerror(errno)));
    }
    if (rename(tmp.c_str(), dir.c_str()) != 0) {
      const std::string error = strerror(errno);
      if (existed) rename(old.c_str(), dir.c_str());
      RemoveTree(tmp);
      return absl::InternalError(absl::StrCat("directory: cannot rename into ", dir, ": ", error));
    }
    if (existed) RemoveTree(old);
    response->set_directory(dir);
    return absl::OkStatus();
  };
  return Finish("SaveCheckpoint", start, run());
}

grpc::Status MoeServiceImpl::DoLoadCheckpoint(grpc::ServerContextBase* context,
                                              const v1::LoadCheckpointRequest* request,
                                              v1::LoadCheckpointResponse*) {
  const absl::Time start = absl::Now();
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::shared_ptr<Layer> found, FindLayer(request->layer()));
    RETURN_IF_ERROR(CheckDirectory(request->directory()));
    // The way back for a diverged layer: every worker loads the same state.
    ASSIGN_OR_RETURN(std::unique_ptr<Turn> turn,
                     TakeTurn(found, context, /*require_serving=*/true, /*allow_diverged=*/true));
    Layer& layer = turn->layer();
    internal::WorkerCheckpointRequest call;
    call.set_generation(turn->set.generation);
    call.set_layer_id(layer.id);
    call.set_directory(request->directory());
    // The workers drop their saved steps of this layer on load.
    {
      absl::MutexLock lock(&layer.mu);
      layer.saved.clear();
      layer.saved_bytes = 0;
      layer.accumulated.assign(layer.config.num_experts, 0);
    }
    RETURN_IF_ERROR(ChangeOnWorkers(
        *turn, "LoadCheckpoint", InternalDeadline(context, true),
        [&](int, internal::Worker::Stub* stub, grpc::ClientContext* ctx) {
          internal::WorkerEmpty empty;
          return FromGrpcStatus(stub->LoadCheckpoint(ctx, call, &empty));
        },
        /*collective=*/true));
    absl::MutexLock lock(&layer.mu);
    layer.weights_reset = false;
    layer.ClearDiverged();
    return absl::OkStatus();
  };
  return Finish("LoadCheckpoint", start, run());
}

}  // namespace moe
