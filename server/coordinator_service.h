// moed's side of the worker protocol (moe.internal.Coordinator): Join hands out ranks
// through the WorkerPool; StoreSet/StoreGet serve the rendezvous key-value store the
// workers' communicators bootstrap from.
//
// Threading: gRPC's callback API (server/callback.h). Join (it may ping a previous worker)
// and StoreGet (it waits for its key) run on the service's HandlerPool; `max_handlers`
// (default 1024) bounds them: each waiting worker holds one StoreGet, and a call beyond the
// bound is RESOURCE_EXHAUSTED. StoreSet finishes on gRPC's thread: the store's Set only takes
// its mutex for an insert, and it must get through while StoreGets that wait for it fill the
// pool.
//
//   CoordinatorService coordinator(&pool, std::make_shared<MemoryKeyValueStore>());
//   builder.RegisterService(&coordinator);
#ifndef MOED_SERVER_COORDINATOR_SERVICE_H_
#define MOED_SERVER_COORDINATOR_SERVICE_H_

#include <memory>

#include "engine/comm/kv_store.h"
#include "proto/worker.grpc.pb.h"
#include "server/callback.h"
#include "server/worker_pool.h"

namespace moe {

class CoordinatorService final : public internal::Coordinator::CallbackService {
 public:
  CoordinatorService(WorkerPool* pool, std::shared_ptr<KeyValueStore> store,
                     int max_handlers = 1024)
      : pool_(pool), store_(std::move(store)), handlers_(max_handlers) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const internal::JoinRequest* request,
                                 internal::JoinResponse* response) override {
    return RunUnary(context, &handlers_, [=] { return DoJoin(request, response); });
  }
  grpc::ServerUnaryReactor* StoreSet(grpc::CallbackServerContext* context,
                                     const internal::StoreSetRequest* request,
                                     internal::StoreSetResponse*) override;
  // Holds the call until the key exists, timeout_ms (at most 10 minutes) or the caller's
  // deadline passes, or the call is cancelled (a server shutting down cancels it).
  grpc::ServerUnaryReactor* StoreGet(grpc::CallbackServerContext* context,
                                     const internal::StoreGetRequest* request,
                                     internal::StoreGetResponse* response) override {
    return RunUnary(context, &handlers_, [=] { return DoStoreGet(context, request, response); });
  }

 private:
  grpc::Status DoJoin(const internal::JoinRequest* request, internal::JoinResponse* response);
  grpc::Status DoStoreGet(grpc::ServerContextBase* context,
                          const internal::StoreGetRequest* request,
                          internal::StoreGetResponse* response);

  WorkerPool* const pool_;
  const std::shared_ptr<KeyValueStore> store_;
  // Last: destroyed first, its destructor waits for the running bodies (which use the members
  // above) and joins its threads.
  HandlerPool handlers_;
};

}  // namespace moe

#endif  // MOED_SERVER_COORDINATOR_SERVICE_H_
