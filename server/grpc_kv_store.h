// A KeyValueStore (engine/comm/kv_store.h) backed by the front end's Coordinator service:
// how a worker's Gloo communicator finds its peers. Get long-polls: the front end holds the
// call until the key appears or the timeout passes.
//
//   auto store = std::make_shared<GrpcKeyValueStore>(coordinator_channel);
//   ASSIGN_OR_RETURN(auto comm, MakeGlooCommunicator(store, "g1/world", rank, size, {}));
#ifndef MOED_SERVER_GRPC_KV_STORE_H_
#define MOED_SERVER_GRPC_KV_STORE_H_

#include <grpcpp/channel.h>

#include <memory>
#include <string>

#include "engine/comm/kv_store.h"
#include "proto/worker.grpc.pb.h"

namespace moe {

class GrpcKeyValueStore : public KeyValueStore {
 public:
  explicit GrpcKeyValueStore(std::shared_ptr<grpc::Channel> channel)
      : stub_(internal::Coordinator::NewStub(std::move(channel))) {}

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  std::unique_ptr<internal::Coordinator::Stub> stub_;
};

}  // namespace moe

#endif  // MOED_SERVER_GRPC_KV_STORE_H_
