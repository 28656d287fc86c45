// gRPC server credentials from PEM files: TLS with a certificate and key, optionally
// requiring client certificates signed by a CA (mutual TLS). Plaintext when no files given.
//
//   ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
//                    ServerCredentialsFromFiles({.cert = "server.pem", .key = "server.key"}));
//   builder.AddListeningPort("0.0.0.0:50051", credentials, &port);
#ifndef MOED_SERVER_TLS_H_
#define MOED_SERVER_TLS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace moe {

struct TlsFiles {
  std::string cert;       // PEM certificate chain of the server
  std::string key;        // PEM private key of `cert`
  std::string client_ca;  // PEM CA bundle; set: clients must present a certificate it signed
  bool enabled() const { return !cert.empty() || !key.empty() || !client_ca.empty(); }
};

// Insecure credentials when `files` is empty; INVALID_ARGUMENT when only one of cert and key
// is given or client_ca comes without them; a file that cannot be read names itself.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(
    const TlsFiles& files);

}  // namespace moe

#endif  // MOED_SERVER_TLS_H_
