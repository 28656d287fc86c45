// A gRPC generic service that answers every unary call on kEchoMethod with the request it
// read (the same slices: no copy on the server). The loopback benchmarks' reference server
// (grpc_loopback_bench, ring_bench).
//
//   moe::bench::EchoService service;
//   builder.RegisterCallbackGenericService(&service);
//   stub.UnaryCall(&context, moe::bench::kEchoMethod, grpc::StubOptions(), &request, &answer,
//   done);
#ifndef MOED_BENCH_GRPC_ECHO_H_
#define MOED_BENCH_GRPC_ECHO_H_

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

namespace moe {
namespace bench {

inline constexpr char kEchoMethod[] = "/bench.Echo/Echo";

class EchoService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new Reactor();
  }

 private:
  class Reactor final : public grpc::ServerGenericBidiReactor {
   public:
    Reactor() { StartRead(&message_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      StartWrite(&message_);
    }
    void OnWriteDone(bool) override { Finish(grpc::Status::OK); }
    void OnDone() override { delete this; }

   private:
    grpc::ByteBuffer message_;
  };
};

}  // namespace bench
}  // namespace moe

#endif  // MOED_BENCH_GRPC_ECHO_H_
