// moed's side of the worker protocol (moe.internal.Coordinator): Join hands out ranks
// through the WorkerPool; StoreSet/StoreGet serve the rendezvous key-value store the
// workers' communicators bootstrap from.
//
//   CoordinatorService coordinator(&pool, std::make_shared<MemoryKeyValueStore>());
//   builder.RegisterService(&coordinator);
#ifndef MOED_SERVER_COORDINATOR_SERVICE_H_
#define MOED_SERVER_COORDINATOR_SERVICE_H_

#include <memory>

#include "engine/comm/kv_store.h"
#include "proto/worker.grpc.pb.h"
#include "server/worker_pool.h"

namespace moe {

class CoordinatorService final : public internal::Coordinator::Service {
 public:
  CoordinatorService(WorkerPool* pool, std::shared_ptr<KeyValueStore> store)
      : pool_(pool), store_(std::move(store)) {}

  grpc::Status Join(grpc::ServerContext*, const internal::JoinRequest*,
                    internal::JoinResponse*) override;
  grpc::Status StoreSet(grpc::ServerContext*, const internal::StoreSetRequest*,
                        internal::StoreSetResponse*) override;
  // Holds the call until the key exists, timeout_ms (at most 10 minutes) or the caller's
  // deadline passes.
  grpc::Status StoreGet(grpc::ServerContext*, const internal::StoreGetRequest*,
                        internal::StoreGetResponse*) override;

 private:
  WorkerPool* const pool_;
  const std::shared_ptr<KeyValueStore> store_;
};

}  // namespace moe

#endif  // MOED_SERVER_COORDINATOR_SERVICE_H_
