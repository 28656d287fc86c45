// moed's side of the worker protocol (moe.internal.Coordinator): Join hands out ranks
// through the WorkerPool; StoreSet/StoreGet serve the rendezvous store the workers'
// communicators bootstrap from (server/rendezvous_store.h: bounded, one generation's keys).
// Every call must carry the cluster secret (server/cluster_secret.h): UNAUTHENTICATED without
// it, PERMISSION_DENIED with another one, before anything else is looked at.
//
// Threading: gRPC's callback API (server/callback.h). Join (it may ping a previous worker)
// and StoreGet (it waits for its key) run on the service's HandlerPool; `max_handlers`
// (default 1024) bounds them, and a call beyond it is RESOURCE_EXHAUSTED. Waiting StoreGets
// are bounded far below it by the store (--rendezvous_max_waiting), so Joins always find a
// thread. StoreSet finishes on gRPC's thread: the store's Set only takes its mutex for an
// insert, and it must get through while StoreGets wait for it.
//
//   RendezvousStore store(limits);
//   CoordinatorService coordinator(&pool, &store, secret);
//   builder.RegisterService(&coordinator);
#ifndef MOED_SERVER_COORDINATOR_SERVICE_H_
#define MOED_SERVER_COORDINATOR_SERVICE_H_

#include "proto/worker.grpc.pb.h"
#include "server/callback.h"
#include "server/cluster_secret.h"
#include "server/rendezvous_store.h"
#include "server/worker_pool.h"

namespace moe {

class CoordinatorService final : public internal::Coordinator::CallbackService {
 public:
  // `pool` and `store` outlive the service.
  CoordinatorService(WorkerPool* pool, RendezvousStore* store, ClusterSecret secret,
                     int max_handlers = 1024)
      : pool_(pool), store_(store), secret_(std::move(secret)), handlers_(max_handlers) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const internal::JoinRequest* request,
                                 internal::JoinResponse* response) override;
  grpc::ServerUnaryReactor* StoreSet(grpc::CallbackServerContext* context,
                                     const internal::StoreSetRequest* request,
                                     internal::StoreSetResponse*) override;
  // Holds the call until the key exists, timeout_ms (at most 10 minutes) or the caller's
  // deadline passes, or the call is cancelled (a server shutting down cancels it).
  grpc::ServerUnaryReactor* StoreGet(grpc::CallbackServerContext* context,
                                     const internal::StoreGetRequest* request,
                                     internal::StoreGetResponse* response) override;

 private:
  grpc::Status DoJoin(const internal::JoinRequest* request, internal::JoinResponse* response);
  grpc::Status DoStoreGet(grpc::ServerContextBase* context,
                          const internal::StoreGetRequest* request,
                          internal::StoreGetResponse* response);

  WorkerPool* const pool_;
  RendezvousStore* const store_;
  const ClusterSecret secret_;
  // Last: destroyed first, its destructor waits for the running bodies (which use the members
  // above) and joins its threads.
  HandlerPool handlers_;
};

}  // namespace moe

#endif  // MOED_SERVER_COORDINATOR_SERVICE_H_
