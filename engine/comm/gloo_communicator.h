// The Gloo communicator: the ranks of an expert-parallel group on CPUs, connected by Gloo's TCP
// transport in a full mesh. Buffers are host memory.
//
// Rendezvous: every rank publishes its listening addresses in `store` under keys
// "<prefix>/<rank>" (Gloo's keys with our prefix) and waits for the others'. The prefix names
// one group: a new group after a restart must use a new prefix (stale addresses stay in the
// store). Every collective has CommOptions::timeout. A Gloo error (a peer that exited, a
// timeout, a reset connection) is returned as a Status: UNAVAILABLE for a lost peer or I/O
// error, DEADLINE_EXCEEDED for a timeout. After any failure the communicator is broken: Gloo
// closes every connection of the group, and every later call fails at once with UNAVAILABLE.
//
// AllToAllV first exchanges the byte counts (one fixed-size all-to-all) and checks them
// against recv_bytes: Gloo itself would abort the process on a peer that sends more than
// expected and leave the buffer's tail unwritten on one that sends less. A mismatch returns
// INVALID_ARGUMENT on the rank that expects wrongly and breaks the group (its peers get
// UNAVAILABLE at once instead of waiting for the timeout). Bad arguments of the rank's own
// (its own pair of sizes differs, a wrong number of sizes, a null buffer) do the same.
//
// Calls are serialised by an internal mutex (a collective from two threads at once would
// interleave on the wire); use one communicator per layer thread. The communicators of a
// process share a few Gloo devices (each one event-loop thread), not one device each: a
// thousand layers do not cost a thousand threads.
//
// Creating one makes the process ignore SIGPIPE: a write to a dead peer must become an error,
// not kill the worker.
//
//   ASSIGN_OR_RETURN(std::shared_ptr<FileKeyValueStore> store, FileKeyValueStore::Create(dir));
//   ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
//                    MakeGlooCommunicator(store, "step-group-1", rank, size, CommOptions{}));
//   RETURN_IF_ERROR(comm->AllReduceSum(counts.data(), counts.size(), DType::kInt64));
#ifndef MOED_ENGINE_COMM_GLOO_COMMUNICATOR_H_
#define MOED_ENGINE_COMM_GLOO_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/comm/communicator.h"
#include "engine/comm/kv_store.h"

namespace moe {

// Where this rank listens (moe-worker: --gloo_iface, --gloo_hostname): on the address of
// network interface `iface` (e.g. "eth0"), or of `hostname` (a name or address of this host);
// with both empty, the address this host's name resolves to (as PyTorch's Gloo does).
struct GlooTransportOptions {
  std::string iface;
  std::string hostname;
};

absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(
    std::shared_ptr<KeyValueStore> store, const std::string& prefix, int rank, int size,
    const CommOptions& options, const GlooTransportOptions& transport = {});

}  // namespace moe

#endif  // MOED_ENGINE_COMM_GLOO_COMMUNICATOR_H_
