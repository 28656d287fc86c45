// Mutual TLS on the internal plane (moed --internal_tls_*, moe-worker --internal_tls_*), with a
// throwaway CA and one member certificate made by openssl at test time:
//   - external workers started with the flags join, the cluster serves Forward;
//   - an outsider speaking plaintext to moed's internal port or a worker's port, even holding
//     the cluster secret, fails the handshake (UNAVAILABLE); so does one with a certificate of
//     another CA;
//   - a worker started without the flags cannot join;
//   - embedded workers inherit moed's settings and the cluster serves.
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// CA, one member certificate for localhost / 127.0.0.1 (every member presents it), and a
// self-signed intruder certificate. Returns the folder.
std::string MakeCertificates() {
  const std::string dir = ::testing::TempDir() + "/internal_certs";
  const std::string script = absl::StrCat(
      "set -e; mkdir -p ", dir, "; cd ", dir,
      "; ec='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'"
      "; openssl req -x509 $ec -keyout ca.key -out ca.pem -days 1 -subj /CN=moe-internal-ca"
      "; openssl req $ec -keyout member.key -out member.csr -subj /CN=moe-internal"
      "; printf 'subjectAltName=DNS:moe-internal,DNS:localhost,IP:127.0.0.1' > san.ext"
      "; openssl x509 -req -in member.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1"
      " -extfile san.ext -out member.pem"
      "; openssl req -x509 $ec -keyout other.key -out other.pem -days 1 -subj /CN=moe-internal"
      " -addext subjectAltName=IP:127.0.0.1",
      " > openssl.log 2>&1");
  EXPECT_EQ(std::system(script.c_str()), 0) << "openssl failed: see " << dir << "/openssl.log";
  return dir;
}

std::vector<std::string> TlsFlags(const std::string& dir) {
  return {"--internal_tls_cert_file=" + dir + "/member.pem",
          "--internal_tls_key_file=" + dir + "/member.key",
          "--internal_tls_ca_file=" + dir + "/ca.pem"};
}

// A Coordinator StoreGet carrying `secret` over `credentials`: its status.
grpc::Status CallCoordinator(const std::string& address,
                             std::shared_ptr<grpc::ChannelCredentials> credentials,
                             const std::string& secret) {
  auto stub = internal::Coordinator::NewStub(grpc::CreateChannel(address, credentials));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ctx.AddMetadata("x-moe-cluster-secret", secret);
  internal::StoreGetRequest request;
  request.set_key("g0/probe");
  request.set_timeout_ms(10);
  internal::StoreGetResponse response;
  return stub->StoreGet(&ctx, request, &response);
}

grpc::Status Forward(TestCluster* cluster) {
  grpc::ClientContext ctx;
  v1::CreateLayerRequest create;
  create.set_name("ffn");
  *create.mutable_config() = TinyConfig(/*seed=*/4);
  v1::CreateLayerResponse created;
  grpc::Status s = cluster->stub()->CreateLayer(&ctx, create, &created);
  if (!s.ok()) return s;
  grpc::ClientContext fctx;
  v1::ForwardRequest request;
  request.set_layer("ffn");
  *request.mutable_x() = FloatsToProto({4, 32}, RandomFloats(4 * 32, 1));
  v1::ForwardResponse response;
  return cluster->stub()->Forward(&fctx, request, &response);
}

TEST(InternalTlsTest, ExternalWorkersJoinOverMutualTlsAndOutsidersCannotConnect) {
  const std::string dir = MakeCertificates();
  ClusterOptions options;
  options.moed_flags = TlsFlags(dir);
  options.worker_flags = TlsFlags(dir);
  auto cluster = TestCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  grpc::Status forward = Forward(cluster->get());
  EXPECT_TRUE(forward.ok()) << forward.error_message();

  const std::string secret = (*cluster)->cluster_secret();
  // Plaintext to the TLS port, even with the secret: no handshake.
  EXPECT_EQ(
      CallCoordinator((*cluster)->internal_address(), grpc::InsecureChannelCredentials(), secret)
          .error_code(),
      grpc::StatusCode::UNAVAILABLE);
  // TLS trusting the CA but presenting no certificate, or another CA's: refused as well.
  grpc::SslCredentialsOptions no_cert;
  no_cert.pem_root_certs = ReadFile(dir + "/ca.pem");
  EXPECT_EQ(CallCoordinator((*cluster)->internal_address(), grpc::SslCredentials(no_cert), secret)
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
  grpc::SslCredentialsOptions foreign = no_cert;
  foreign.pem_cert_chain = ReadFile(dir + "/other.pem");
  foreign.pem_private_key = ReadFile(dir + "/other.key");
  EXPECT_EQ(CallCoordinator((*cluster)->internal_address(), grpc::SslCredentials(foreign), secret)
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // A member's certificate works (the call reaches the Coordinator: the key is not there).
  grpc::SslCredentialsOptions member = no_cert;
  member.pem_cert_chain = ReadFile(dir + "/member.pem");
  member.pem_private_key = ReadFile(dir + "/member.key");
  EXPECT_NE(CallCoordinator((*cluster)->internal_address(), grpc::SslCredentials(member), secret)
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(*(*cluster)->Health(), "SERVING");
}

TEST(InternalTlsTest, AWorkerWithoutTheCertificateCannotJoin) {
  const std::string dir = MakeCertificates();
  ClusterOptions options;
  options.workers = 2;
  options.moed_flags = TlsFlags(dir);
  options.worker_flags = {"--join_timeout_s=3"};  // plaintext workers: the join never lands
  auto cluster = TestCluster::Start(options);
  EXPECT_FALSE(cluster.ok());
}

TEST(InternalTlsTest, EmbeddedWorkersInheritTheSettings) {
  const std::string dir = MakeCertificates();
  ClusterOptions options;
  options.embedded = true;
  options.moed_flags = TlsFlags(dir);
  auto cluster = TestCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  grpc::Status forward = Forward(cluster->get());
  EXPECT_TRUE(forward.ok()) << forward.error_message();
  // The internal port speaks TLS only.
  EXPECT_EQ(CallCoordinator((*cluster)->internal_address(), grpc::InsecureChannelCredentials(), "x")
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace moe
