// The internal plane's shared secret: moed, its Coordinator and every moe-worker hold the same
// random string; every internal call carries it in the metadata entry kClusterSecretMetadata,
// and both services refuse a call without it (UNAUTHENTICATED) or with another one
// (PERMISSION_DENIED). It proves membership only: the channels are plaintext unless the
// internal plane's TLS is on (server/internal_tls.h), and Gloo/NCCL traffic is not covered
// (docs/SECURITY.md, "Internal plane").
//
// Where it comes from: moed generates one at start (32 random bytes, hex) unless given
// --cluster_secret_file; embedded workers inherit it through a memfd whose number is on their
// command line (the secret never is); external workers read --cluster_secret_file.
//
//   ASSIGN_OR_RETURN(ClusterSecret secret, ClusterSecret::FromFile(path));
//   auto stub = internal::Worker::NewStub(secret.Channel(address, args));  // calls carry it
//   grpc::Status denied = secret.Check(*context);                          // in a handler
//   if (!denied.ok()) return denied;
#ifndef MOED_SERVER_CLUSTER_SECRET_H_
#define MOED_SERVER_CLUSTER_SECRET_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace moe {

// gRPC metadata key of the secret (lower case, as HTTP/2 requires).
inline constexpr char kClusterSecretMetadata[] = "x-moe-cluster-secret";

class ClusterSecret {
 public:
  // A secret given by the caller (tests); at least kMinLength printable characters.
  static absl::StatusOr<ClusterSecret> FromString(std::string value);
  // 32 bytes from the kernel's random source, as 64 hex digits.
  static absl::StatusOr<ClusterSecret> Generate();
  // The file's content without trailing whitespace (a Kubernetes Secret mounted as a file).
  static absl::StatusOr<ClusterSecret> FromFile(const std::string& path);
  // Reads an inherited file descriptor from offset 0 and closes it.
  static absl::StatusOr<ClusterSecret> FromFd(int fd);

  // A memfd holding the secret, close-on-exec: a launcher clears the flag in its child only
  // and passes the number (server/worker_launcher.cc). The caller closes it.
  absl::StatusOr<int> ToMemfd() const;

  // OK when the call carries this secret; UNAUTHENTICATED when it carries none,
  // PERMISSION_DENIED when it carries another (compared in constant time).
  grpc::Status Check(const grpc::ServerContextBase& context) const;

  // A channel whose every call carries the secret (a client interceptor adds it); plaintext
  // unless UseChannelCredentials.
  std::shared_ptr<grpc::Channel> Channel(const std::string& target,
                                         const grpc::ChannelArguments& args) const;
  // Channel() uses `credentials` from now on (the internal plane's TLS: server/internal_tls.h),
  // checking servers' certificates against `server_name` when not empty.
  void UseChannelCredentials(std::shared_ptr<grpc::ChannelCredentials> credentials,
                             std::string server_name) {
    credentials_ = std::move(credentials);
    server_name_ = std::move(server_name);
  }

  const std::string& value() const { return value_; }

  static constexpr size_t kMinLength = 32;

 private:
  explicit ClusterSecret(std::string value) : value_(std::move(value)) {}
  std::string value_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;  // null: plaintext
  std::string server_name_;
};

}  // namespace moe

#endif  // MOED_SERVER_CLUSTER_SECRET_H_
