// The grpc.health.v1 names moed and moe-worker serve, for probes and `moectl health --service`.
//
//   ""  and the main service ("moe.v1.MoeService" on moed, "moe.internal.Worker" on a worker):
//       readiness. moed: SERVING only while every worker is up. moe-worker: SERVING once it has
//       joined and its communicators of the current generation are up, while the front end
//       keeps pinging it.
//   kLivenessService ("liveness"): SERVING as long as the process runs and serves gRPC. For
//       liveness probes, which must not follow readiness: a front end with a lost worker, or a
//       worker whose front end is away, recovers by itself, and a restart would drop state.
//
//   grpc::EnableDefaultHealthCheckService(true);  ...  server = builder.BuildAndStart();
//   InitHealth(server->GetHealthCheckService(), "moe.v1.MoeService");
//   SetReadiness(server->GetHealthCheckService(), "moe.v1.MoeService", pool.serving());
#ifndef MOED_SERVER_HEALTH_H_
#define MOED_SERVER_HEALTH_H_

#include <grpcpp/health_check_service_interface.h>

#include <string>

namespace moe {

inline constexpr char kLivenessService[] = "liveness";

// Readiness of "" and `service`. Not SetServingStatus(bool): that sets every name, liveness too.
inline void SetReadiness(grpc::HealthCheckServiceInterface* health, const std::string& service,
                         bool ready) {
  health->SetServingStatus("", ready);
  health->SetServingStatus(service, ready);
}

// Liveness SERVING, readiness NOT_SERVING: the state of a process that just started.
inline void InitHealth(grpc::HealthCheckServiceInterface* health, const std::string& service) {
  health->SetServingStatus(kLivenessService, true);
  SetReadiness(health, service, false);
}

}  // namespace moe

#endif  // MOED_SERVER_HEALTH_H_
