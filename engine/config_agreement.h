// Every rank of an expert-parallel group must hold the same LayerConfig: the sizes of the
// layer's collectives (count all-gathers, all-to-all splits, gate all-reduces) follow from it,
// and a rank that disagrees would make the transport see mismatched sizes, which Gloo answers
// by aborting the process. CheckConfigAgreement all-gathers a 64-bit fingerprint of the
// config (8 bytes on every rank whatever the config, so the check itself cannot mismatch) and
// fails on every rank alike when any two differ. Call it once, right after the layer's
// communicator exists and before any other collective on it.
//
//   RETURN_IF_ERROR(CheckConfigAgreement(config, backend, comm));  // collective
//   ASSIGN_OR_RETURN(auto layer, MoeLayer::Create(config, backend, comm));
#ifndef MOED_ENGINE_CONFIG_AGREEMENT_H_
#define MOED_ENGINE_CONFIG_AGREEMENT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "engine/backend.h"
#include "engine/comm/communicator.h"
#include "engine/config.h"

namespace moe {

// FNV-1a 64 of ConfigToString(config): the same in every process and build (unlike
// absl::Hash, which is seeded per process).
uint64_t ConfigFingerprint(const LayerConfig& config);

// Collective. OK when every rank passed the same config; FAILED_PRECONDITION on every rank
// when not (the message lists each rank's fingerprint); the communicator's error when the
// all-gather fails. `backend` provides the buffers when the communicator works on device
// memory.
absl::Status CheckConfigAgreement(const LayerConfig& config, Backend* backend, Communicator* comm);

}  // namespace moe

#endif  // MOED_ENGINE_CONFIG_AGREEMENT_H_
