// Bearer-token authentication with roles for moed's public API.
//
// A tokens file holds one token per line, as the SHA-256 of the token (hex) and a role:
//
//   # sha256(token)                                                  role    name (optional)
//   9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 admin   ops
//   60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752 train   trainer-7
//
// (`printf %s "$TOKEN" | sha256sum` makes a line's hash; `moed` never sees the tokens in the
// clear on disk.) Roles are ordered; each includes the ones before it:
//   read   health, ListLayers, GetLayer, GetStatus, GetWeights
//   infer  Forward without keep_for_backward, shared-memory registration
//   train  Forward with keep, Backward, ReleaseStep, gradients, ApplyOptimizer, expert bias
//   admin  CreateLayer, DeleteLayer, SetWeights, Save/LoadCheckpoint
// A client sends `authorization: Bearer <token>` metadata. Without a tokens file every call
// is allowed: moed then refuses to listen beyond loopback (moed_main.cc).
//
//   ASSIGN_OR_RETURN(std::unique_ptr<TokenAuthenticator> auth,
//                    TokenAuthenticator::Load("/etc/moed/tokens"));
//   RETURN_IF_ERROR(auth->Authorize(*context, Role::kTrain));   // in a handler
//   auth->Reload();                                              // on SIGHUP
#ifndef MOED_SERVER_AUTH_H_
#define MOED_SERVER_AUTH_H_

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace moe {

enum class Role { kRead = 0, kInfer = 1, kTrain = 2, kAdmin = 3 };

absl::string_view RoleName(Role role);
absl::StatusOr<Role> ParseRole(absl::string_view name);

// Lowercase hex SHA-256 of `data`.
std::string Sha256Hex(absl::string_view data);

class TokenAuthenticator {
 public:
  // Reads `path`. INVALID_ARGUMENT naming the line for a malformed one; an unreadable file
  // is NOT_FOUND / PERMISSION_DENIED.
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> Load(const std::string& path);

  // Reads the file again; on error keeps the tokens it had and returns the error.
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);

  // OK when the call's bearer token is known and its role includes `needed`.
  // UNAUTHENTICATED: no `authorization: Bearer` metadata, or an unknown token.
  // PERMISSION_DENIED: a known token whose role is below `needed` (the message names both).
  absl::Status Authorize(const grpc::ServerContextBase& context, Role needed) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The SHA-256 (hex) of the call's bearer token, as the tokens file lists it;
  // UNAUTHENTICATED as Authorize when the call has none.
  static absl::StatusOr<std::string> TokenHash(const grpc::ServerContextBase& context);
  // Authorize for a token known by its hash (a step channel's identity, captured when the
  // channel opened): UNAUTHENTICATED once the token is no longer in the file.
  absl::Status AuthorizeHash(const std::string& hash, Role needed) const ABSL_LOCKS_EXCLUDED(mu_);

  int size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    Role role;
    std::string name;
  };
  explicit TokenAuthenticator(std::string path) : path_(std::move(path)) {}
  static absl::StatusOr<std::map<std::string, Entry>> Parse(const std::string& path);

  const std::string path_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> by_hash_ ABSL_GUARDED_BY(mu_);  // sha256 hex -> entry
};

// What a handler asks: with no authenticator (no tokens file) everything is allowed.
inline absl::Status Authorize(const TokenAuthenticator* auth,
                              const grpc::ServerContextBase& context, Role needed) {
  return auth == nullptr ? absl::OkStatus() : auth->Authorize(context, needed);
}

}  // namespace moe

#endif  // MOED_SERVER_AUTH_H_
