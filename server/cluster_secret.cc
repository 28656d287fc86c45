#include "server/cluster_secret.h"

#include <grpcpp/support/client_interceptor.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace moe {
namespace {

constexpr size_t kRandomBytes = 32;
constexpr size_t kMaxLength = 4096;

// Adds the secret to the initial metadata of every call of the channel.
class SecretInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit SecretInterceptor(const std::string* secret) : secret_(secret) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kClusterSecretMetadata, *secret_);
    }
    methods->Proceed();
  }

 private:
  const std::string* const secret_;
};

class SecretInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit SecretInterceptorFactory(std::string secret) : secret_(std::move(secret)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new SecretInterceptor(&secret_);  // gRPC owns it; the factory outlives the channel
  }

 private:
  const std::string secret_;
};

// Equal length and content, in time that depends on the lengths only.
bool ConstantTimeEquals(grpc::string_ref given, const std::string& expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given.data()[i]) ^
            static_cast<unsigned char>(expected[i % expected.size()]);
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<ClusterSecret> ClusterSecret::FromString(std::string value) {
  absl::StripTrailingAsciiWhitespace(&value);
  if (value.size() < kMinLength || value.size() > kMaxLength) {
    return absl::InvalidArgumentError(absl::StrCat("cluster secret: ", value.size(),
                                                   " characters, expected ", kMinLength, " to ",
                                                   kMaxLength, " (e.g. openssl rand -hex 32)"));
  }
  for (char c : value) {
    // Metadata values must be printable ASCII.
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          "cluster secret: only printable ASCII without spaces (e.g. openssl rand -hex 32)");
    }
  }
  return ClusterSecret(std::move(value));
}

absl::StatusOr<ClusterSecret> ClusterSecret::Generate() {
  unsigned char bytes[kRandomBytes];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(absl::StrCat("getrandom: ", strerror(errno)));
    got += static_cast<size_t>(n);
  }
  return ClusterSecret(
      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(bytes), sizeof(bytes))));
}

absl::StatusOr<ClusterSecret> ClusterSecret::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cluster secret file ", path, ": cannot open (", strerror(errno), ")"));
  }
  std::ostringstream content;
  content << in.rdbuf();
  absl::StatusOr<ClusterSecret> secret = FromString(content.str());
  if (!secret.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", secret.status().message()));
  }
  return secret;
}

absl::StatusOr<ClusterSecret> ClusterSecret::FromFd(int fd) {
  std::string content(kMaxLength + 1, '\0');
  size_t got = 0;
  while (got < content.size()) {
    const ssize_t n = pread(fd, content.data() + got, content.size() - got, got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return absl::InvalidArgumentError(
          absl::StrCat("cluster secret fd ", fd, ": ", strerror(err)));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  content.resize(got);
  return FromString(std::move(content));
}

absl::StatusOr<int> ClusterSecret::ToMemfd() const {
  const int fd = memfd_create("moed-cluster-secret", MFD_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", strerror(errno)));
  size_t put = 0;
  while (put < value_.size()) {
    const ssize_t n = write(fd, value_.data() + put, value_.size() - put);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return absl::InternalError(absl::StrCat("memfd write: ", strerror(err)));
    }
    put += static_cast<size_t>(n);
  }
  return fd;
}

grpc::Status ClusterSecret::Check(const grpc::ServerContextBase& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kClusterSecretMetadata);
  if (it == metadata.end()) {
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        absl::StrCat("internal call without the cluster secret (metadata ", kClusterSecretMetadata,
                     "): only moed and its workers "
                     "may call this service"));
  }
  if (!ConstantTimeEquals(it->second, value_)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "internal call with a wrong cluster secret (moed and the workers must "
                        "share one: --cluster_secret_file)");
  }
  return grpc::Status::OK;
}

std::shared_ptr<grpc::Channel> ClusterSecret::Channel(const std::string& target,
                                                      const grpc::ChannelArguments& args) const {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<SecretInterceptorFactory>(value_));
  grpc::ChannelArguments channel_args = args;
  if (credentials_ != nullptr && !server_name_.empty()) {
    channel_args.SetSslTargetNameOverride(server_name_);
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      target, credentials_ != nullptr ? credentials_ : grpc::InsecureChannelCredentials(),
      channel_args, std::move(factories));
}

}  // namespace moe
