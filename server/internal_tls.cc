#include "server/internal_tls.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "engine/file_util.h"
#include "engine/status_macros.h"

ABSL_FLAG(std::string, internal_tls_cert_file, "",
          "internal plane (moed <-> moe-worker): this member's TLS certificate chain (PEM); "
          "with --internal_tls_key_file and --internal_tls_ca_file turns on mutual TLS. "
          "Embedded workers inherit moed's settings");
ABSL_FLAG(std::string, internal_tls_key_file, "",
          "internal plane: private key (PEM) of --internal_tls_cert_file");
ABSL_FLAG(std::string, internal_tls_ca_file, "",
          "internal plane: CA bundle (PEM); peers must present a certificate it signed");
ABSL_FLAG(std::string, internal_tls_server_name, "",
          "internal plane: name the peers' certificates are checked against (empty: the host "
          "of the address dialled; set it when one certificate, e.g. for \"moe-internal\", "
          "serves every member)");

namespace moe {
namespace {

absl::StatusOr<std::string> ReadFlagFile(const char* flag, const std::string& path) {
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("--", flag, ": ", text.status().message()));
  }
  return text;
}

absl::Status CheckComplete(const InternalTlsFiles& files) {
  if (files.cert.empty() || files.key.empty() || files.ca.empty()) {
    return absl::InvalidArgumentError(
        "internal TLS needs all of --internal_tls_cert_file, --internal_tls_key_file and "
        "--internal_tls_ca_file (mutual TLS: every member presents a certificate and checks "
        "its peers')");
  }
  return absl::OkStatus();
}

}  // namespace

InternalTlsFiles InternalTlsFromFlags() {
  return InternalTlsFiles{
      absl::GetFlag(FLAGS_internal_tls_cert_file), absl::GetFlag(FLAGS_internal_tls_key_file),
      absl::GetFlag(FLAGS_internal_tls_ca_file), absl::GetFlag(FLAGS_internal_tls_server_name)};
}

std::vector<std::string> InternalTlsFlagsForChild() {
  const InternalTlsFiles files = InternalTlsFromFlags();
  std::vector<std::string> args;
  if (!files.cert.empty()) args.push_back("--internal_tls_cert_file=" + files.cert);
  if (!files.key.empty()) args.push_back("--internal_tls_key_file=" + files.key);
  if (!files.ca.empty()) args.push_back("--internal_tls_ca_file=" + files.ca);
  if (!files.server_name.empty()) {
    args.push_back("--internal_tls_server_name=" + files.server_name);
  }
  return args;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> InternalServerCredentials(
    const InternalTlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  RETURN_IF_ERROR(CheckComplete(files));
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.private_key, ReadFlagFile("internal_tls_key_file", files.key));
  ASSIGN_OR_RETURN(pair.cert_chain, ReadFlagFile("internal_tls_cert_file", files.cert));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  ASSIGN_OR_RETURN(options.pem_root_certs, ReadFlagFile("internal_tls_ca_file", files.ca));
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> InternalChannelCredentials(
    const InternalTlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  RETURN_IF_ERROR(CheckComplete(files));
  grpc::SslCredentialsOptions options;
  ASSIGN_OR_RETURN(options.pem_root_certs, ReadFlagFile("internal_tls_ca_file", files.ca));
  ASSIGN_OR_RETURN(options.pem_private_key, ReadFlagFile("internal_tls_key_file", files.key));
  ASSIGN_OR_RETURN(options.pem_cert_chain, ReadFlagFile("internal_tls_cert_file", files.cert));
  return grpc::SslCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> SetUpInternalTls(ClusterSecret* secret) {
  const InternalTlsFiles files = InternalTlsFromFlags();
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> server,
                   InternalServerCredentials(files));
  if (files.enabled()) {
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> channel,
                     InternalChannelCredentials(files));
    secret->UseChannelCredentials(std::move(channel), files.server_name);
  }
  return server;
}

}  // namespace moe
