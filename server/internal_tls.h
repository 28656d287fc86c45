// Mutual TLS on the internal plane (moed's Coordinator port, every moe-worker's port, and the
// channels between them), from the --internal_tls_* flags that moed and moe-worker both
// define here. Every member presents the certificate --internal_tls_cert_file and accepts only
// peers whose certificate --internal_tls_ca_file signed; one certificate and key may be
// shared by all members. Without the flags the internal plane is plaintext (the cluster
// secret still authenticates every call: server/cluster_secret.h).
//
//   ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
//                    SetUpInternalTls(&secret));   // secret.Channel(...) now speaks TLS
//   builder.AddListeningPort(address, credentials, &port);
//   launcher_args = InternalTlsFlagsForChild();    // embedded workers: the same settings
#ifndef MOED_SERVER_INTERNAL_TLS_H_
#define MOED_SERVER_INTERNAL_TLS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/cluster_secret.h"

namespace moe {

struct InternalTlsFiles {
  std::string cert;  // PEM certificate chain this member presents (as server and as client)
  std::string key;   // PEM private key of `cert`
  std::string ca;    // PEM CA bundle: peers must present a certificate it signed
  // Name peers' certificates are checked against instead of the host of the address dialled
  // (workers are dialled by IP); empty: the address's host.
  std::string server_name;
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// The --internal_tls_cert_file, --internal_tls_key_file, --internal_tls_ca_file and
// --internal_tls_server_name flags.
InternalTlsFiles InternalTlsFromFlags();

// Those flags as command-line arguments for a child moe-worker (embedded mode); empty when
// none is set. They name files, never their contents.
std::vector<std::string> InternalTlsFlagsForChild();

// Server credentials of an internal listener: TLS requiring and verifying client certificates
// when `files` is enabled, else insecure. INVALID_ARGUMENT unless cert, key and ca are all
// given; a file that cannot be read names its flag.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> InternalServerCredentials(
    const InternalTlsFiles& files);

// Channel credentials of internal calls: TLS checking the server against ca and presenting
// cert; insecure when `files` is not enabled. Errors as InternalServerCredentials.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> InternalChannelCredentials(
    const InternalTlsFiles& files);

// From the flags: sets `secret`'s channels (ClusterSecret::Channel) to TLS and returns the
// internal listener's credentials (both plaintext without the flags).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> SetUpInternalTls(ClusterSecret* secret);

}  // namespace moe

#endif  // MOED_SERVER_INTERNAL_TLS_H_
