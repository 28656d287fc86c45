// Bearer tokens with roles and (mutual) TLS on moed's public port, against a real cluster:
// missing, unknown and wrong-role tokens, SIGHUP reload, a refusal to listen beyond loopback
// without tokens, and mTLS end to end through the C++ client and moectl, with certificates
// made by openssl at test time.
#include "server/auth.h"

#include <signal.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/moe_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster.h"
#include "tests/server/test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) { return ::testing::TempDir() + "/" + name; }

// A tokens file granting each role one token "<role>-token".
std::string WriteTokens(const std::string& name, std::vector<std::string> roles) {
  const std::string path = TempPath(name);
  std::ofstream out(path);
  out << "# test tokens\n";
  for (const std::string& role : roles) {
    out << Sha256Hex(role + "-token") << " " << role << " " << role << "-user\n";
  }
  return path;
}

v1::LayerConfig SmallConfig() {
  v1::LayerConfig config;
  config.set_hidden(16);
  config.set_ffn(32);
  config.set_num_experts(4);
  config.set_top_k(2);
  return config;
}

absl::StatusOr<std::unique_ptr<client::MoeClient>> ClientWith(const std::string& address,
                                                              client::ClientOptions options) {
  options.default_deadline = absl::Seconds(20);
  return client::MoeClient::Connect(address, options);
}

TEST(AuthTest, TokensAndRoles) {
  const std::string tokens = WriteTokens("tokens", {"read", "infer", "train", "admin"});
  ClusterOptions options;
  options.moed_flags = {"--tokens_file=" + tokens};
  auto cluster = TestCluster::Start(options);  // health needs no token
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->address();
  auto as = [&](const std::string& token) {
    client::ClientOptions o;
    o.token = token;
    return std::move(*ClientWith(address, o));
  };
  auto nobody = as("");
  auto stranger = as("not-a-token");
  auto reader = as("read-token");
  auto inferer = as("infer-token");
  auto trainer = as("train-token");
  auto admin = as("admin-token");

  absl::Status s = nobody->CreateLayer("l", SmallConfig()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_THAT(s.message(), HasSubstr("Bearer"));
  EXPECT_EQ(nobody->ListLayers().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(stranger->ListLayers().status().code(), absl::StatusCode::kUnauthenticated);
  s = reader->CreateLayer("l", SmallConfig()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("needs admin"));
  EXPECT_EQ(trainer->CreateLayer("l", SmallConfig()).status().code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(admin->CreateLayer("l", SmallConfig()).ok());

  // read: listing and weights, nothing that computes or changes.
  EXPECT_TRUE(reader->ListLayers().ok());
  EXPECT_TRUE(reader->GetWeights("l", {"gate"}).ok());
  EXPECT_EQ(nobody->GetWeights("l", {"gate"}).status().code(), absl::StatusCode::kUnauthenticated);
  Tensor x = Tensor::FromFloats({8, 16}, RandomFloats(8 * 16, 1));
  EXPECT_EQ(reader->Forward("l", x, false).status().code(), absl::StatusCode::kPermissionDenied);
  // infer: Forward without keep only.
  EXPECT_TRUE(inferer->Forward("l", x, false).ok());
  EXPECT_EQ(inferer->Forward("l", x, true).status().code(), absl::StatusCode::kPermissionDenied);
  // train: keep, Backward, gradients, optimizer; not SetWeights or checkpoints.
  auto fwd = trainer->Forward("l", x, true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(trainer->Backward("l", fwd->step_id, x).ok());
  EXPECT_TRUE(trainer->GetGradients("l").ok());
  EXPECT_EQ(inferer->GetGradients("l").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(trainer->ZeroGradients("l").ok());
  auto weights = admin->GetWeights("l", {"gate"});
  ASSERT_TRUE(weights.ok());
  EXPECT_EQ(trainer->SetWeights("l", *weights).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(admin->SetWeights("l", *weights).ok());
  EXPECT_EQ(trainer->SaveCheckpoint("l", "c").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(admin->SaveCheckpoint("l", "c").ok());
  EXPECT_EQ(trainer->DeleteLayer("l").code(), absl::StatusCode::kPermissionDenied);

  // SIGHUP reloads the file: the train token is gone, a new one works.
  {
    std::ofstream out(tokens);
    out << Sha256Hex("admin-token") << " admin\n" << Sha256Hex("fresh-token") << " train\n";
  }
  (*cluster)->NotifyMoed(SIGHUP);
  auto fresh = as("fresh-token");
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (absl::Now() < give_up && !fresh->ListLayers().ok()) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(fresh->ListLayers().ok());
  EXPECT_EQ(trainer->ListLayers().status().code(), absl::StatusCode::kUnauthenticated);
  // A broken file on reload keeps the tokens moed had.
  { std::ofstream(tokens) << "garbage\n"; }
  (*cluster)->NotifyMoed(SIGHUP);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(fresh->ListLayers().ok());
  EXPECT_TRUE((*cluster)->MoedRunning());
  EXPECT_EQ(*(*cluster)->Health(), "SERVING");
}

TEST(AuthTest, NoTokensFileMeansLoopbackOnly) {
  const std::string moed = RunfilePath("server/moed");
  for (const char* listen : {"0.0.0.0", "::"}) {
    const std::string command =
        absl::StrCat("timeout 10 ", moed, " --port=0 --listen=", listen,
                     " --expect_workers=1 --cluster_secret_file=", TestClusterSecretFile(),
                     " --checkpoint_root=", TempPath("noauth_root"), " 2>", TempPath("noauth.log"));
    const int status = std::system(command.c_str());
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 2) << listen;
    std::ifstream in(TempPath("noauth.log"));
    EXPECT_THAT(std::string(std::istreambuf_iterator<char>(in), {}), HasSubstr("--tokens_file"));
  }
  // A malformed tokens file is refused at start, naming the line.
  { std::ofstream(TempPath("bad_tokens")) << "abc admin\n"; }
  const std::string command = absl::StrCat(
      "timeout 10 ", moed,
      " --port=0 --expect_workers=1 --cluster_secret_file=", TestClusterSecretFile(),
      " --tokens_file=", TempPath("bad_tokens"), " --checkpoint_root=", TempPath("noauth_root"),
      " 2>", TempPath("bad_tokens.log"));
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  std::ifstream in(TempPath("bad_tokens.log"));
  EXPECT_THAT(std::string(std::istreambuf_iterator<char>(in), {}), HasSubstr("bad_tokens:1"));
}

// Throwaway CA, server certificate (localhost / 127.0.0.1) and client certificate.
bool MakeCertificates(const std::string& dir) {
  const std::string script = absl::StrCat(
      "set -e; cd ", dir,
      "; ec='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'"
      "; openssl req -x509 $ec -keyout ca.key -out ca.pem -days 1 -subj /CN=moed-test-ca"
      "; openssl req $ec -keyout server.key -out server.csr -subj /CN=localhost"
      "; printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext"
      "; openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1"
      " -extfile san.ext -out server.pem"
      "; openssl req $ec -keyout client.key -out client.csr -subj /CN=trainer"
      "; openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1"
      " -out client.pem"
      "; openssl req -x509 $ec -keyout other.key -out other.pem -days 1 -subj /CN=intruder",
      " > openssl.log 2>&1");
  return std::system(script.c_str()) == 0;
}

TEST(AuthTest, MutualTlsWithTokensEndToEnd) {
  const std::string dir = TempPath("certs");
  std::system(("mkdir -p " + dir).c_str());
  ASSERT_TRUE(MakeCertificates(dir)) << "openssl failed: see " << dir << "/openssl.log";
  const std::string tokens = WriteTokens("tls_tokens", {"admin"});
  ClusterOptions options;
  options.moed_flags = {"--tokens_file=" + tokens, "--tls_cert_file=" + dir + "/server.pem",
                        "--tls_key_file=" + dir + "/server.key",
                        "--tls_client_ca_file=" + dir + "/ca.pem"};
  grpc::SslCredentialsOptions ssl;
  std::ifstream ca(dir + "/ca.pem"), cert(dir + "/client.pem"), key(dir + "/client.key");
  ssl.pem_root_certs = std::string(std::istreambuf_iterator<char>(ca), {});
  ssl.pem_cert_chain = std::string(std::istreambuf_iterator<char>(cert), {});
  ssl.pem_private_key = std::string(std::istreambuf_iterator<char>(key), {});
  options.credentials = grpc::SslCredentials(ssl);
  auto cluster = TestCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->address();

  client::ClientOptions good;
  good.token = "admin-token";
  good.tls_ca_file = dir + "/ca.pem";
  good.tls_cert_file = dir + "/client.pem";
  good.tls_key_file = dir + "/client.key";
  auto trainer = ClientWith(address, good);
  ASSERT_TRUE(trainer.ok());
  ASSERT_TRUE((*trainer)->CreateLayer("tls", SmallConfig()).ok());
  Tensor x = Tensor::FromFloats({4, 16}, RandomFloats(4 * 16, 2));
  EXPECT_TRUE((*trainer)->Forward("tls", x, false).ok());

  // TLS but the wrong token: UNAUTHENTICATED, as in plaintext.
  client::ClientOptions wrong_token = good;
  wrong_token.token = "nope";
  EXPECT_EQ((*ClientWith(address, wrong_token))->ListLayers().status().code(),
            absl::StatusCode::kUnauthenticated);
  // No client certificate, a certificate of another CA, plaintext to the TLS port: the
  // handshake fails, UNAVAILABLE.
  client::ClientOptions no_cert = good;
  no_cert.tls_cert_file.clear();
  no_cert.tls_key_file.clear();
  EXPECT_EQ((*ClientWith(address, no_cert))->ListLayers().status().code(),
            absl::StatusCode::kUnavailable);
  client::ClientOptions foreign = good;
  foreign.tls_cert_file = dir + "/other.pem";
  foreign.tls_key_file = dir + "/other.key";
  EXPECT_EQ((*ClientWith(address, foreign))->ListLayers().status().code(),
            absl::StatusCode::kUnavailable);
  client::ClientOptions plaintext;
  plaintext.token = "admin-token";
  EXPECT_EQ((*ClientWith(address, plaintext))->ListLayers().status().code(),
            absl::StatusCode::kUnavailable);

  // moectl end to end: token from the environment, CA and client certificate from flags.
  const std::string moectl = RunfilePath("client/moectl");
  const std::string tls_flags =
      absl::StrCat(" --server=", address, " --tls_ca_file=", dir, "/ca.pem --tls_cert_file=", dir,
                   "/client.pem --tls_key_file=", dir, "/client.key");
  int status = std::system(absl::StrCat("MOED_TOKEN=admin-token ", moectl, tls_flags,
                                        " list-layers > ", TempPath("moectl_ok.out"), " 2>&1")
                               .c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  std::ifstream listed(TempPath("moectl_ok.out"));
  EXPECT_THAT(std::string(std::istreambuf_iterator<char>(listed), {}), HasSubstr("tls"));
  status = std::system(absl::StrCat("MOED_TOKEN=wrong ", moectl, tls_flags, " list-layers 2> ",
                                    TempPath("moectl_bad.err"))
                           .c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  std::ifstream refused(TempPath("moectl_bad.err"));
  EXPECT_THAT(std::string(std::istreambuf_iterator<char>(refused), {}),
              HasSubstr("UNAUTHENTICATED"));
}

}  // namespace
}  // namespace moe
