#include "engine/config_agreement.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/status_macros.h"

namespace moe {

uint64_t ConfigFingerprint(const LayerConfig& config) {
  uint64_t hash = 14695981039346656037ull;  // FNV-1a 64 offset basis
  for (unsigned char c : ConfigToString(config)) {
    hash ^= c;
    hash *= 1099511628211ull;  // FNV prime
  }
  return hash;
}

absl::Status CheckConfigAgreement(const LayerConfig& config, Backend* backend, Communicator* comm) {
  if (backend == nullptr || comm == nullptr) {
    return absl::InvalidArgumentError("CheckConfigAgreement: backend and communicator required");
  }
  const int ranks = comm->size();
  const uint64_t mine = ConfigFingerprint(config);
  std::vector<uint64_t> all(ranks, 0);
  if (comm->memory_space() == MemorySpace::kHost) {
    RETURN_IF_ERROR(comm->AllGather(&mine, all.data(), sizeof(mine)));
  } else {
    // Device collectives (NCCL): stage through backend memory.
    ASSIGN_OR_RETURN(Buffer send, backend->Allocate(sizeof(mine)));
    ASSIGN_OR_RETURN(Buffer recv, backend->Allocate(sizeof(mine) * ranks));
    RETURN_IF_ERROR(backend->CopyFromHost(send.data(), &mine, sizeof(mine)));
    RETURN_IF_ERROR(comm->AllGather(send.data(), recv.data(), sizeof(mine)));
    RETURN_IF_ERROR(backend->CopyToHost(all.data(), recv.data(), sizeof(mine) * ranks));  // waits
  }
  bool same = true;
  for (uint64_t h : all) same = same && h == all[0];
  if (same) return absl::OkStatus();
  std::string hashes;
  for (int r = 0; r < ranks; ++r) {
    absl::StrAppend(&hashes, r == 0 ? "" : ", ", r, ":", absl::StrFormat("%016x", all[r]));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("layer config differs across the ", ranks, " ranks (config fingerprints ",
                   hashes, "); rank ", comm->rank(), " has ", ConfigToString(config)));
}

}  // namespace moe
