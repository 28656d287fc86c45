#include "server/tls.h"

#include "absl/strings/str_cat.h"
#include "engine/file_util.h"
#include "engine/status_macros.h"

namespace moe {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(
    const TlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls_cert_file and --tls_key_file (--tls_client_ca_file adds mutual "
        "TLS on top)");
  }
  auto read = [](const char* flag, const std::string& path) -> absl::StatusOr<std::string> {
    absl::StatusOr<std::string> text = ReadWholeFile(path);
    if (!text.ok()) {
      return absl::Status(text.status().code(), absl::StrCat(flag, ": ", text.status().message()));
    }
    return text;
  };
  grpc::SslServerCredentialsOptions options(
      files.client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.private_key, read("--tls_key_file", files.key));
  ASSIGN_OR_RETURN(pair.cert_chain, read("--tls_cert_file", files.cert));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!files.client_ca.empty()) {
    ASSIGN_OR_RETURN(options.pem_root_certs, read("--tls_client_ca_file", files.client_ca));
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace moe
