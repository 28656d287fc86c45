// Step channels (proto/moe.proto "Step channels") against moed + 2 real moe-workers with
// --allow_client_shm and a tokens file: Forward / Backward / ReleaseStep through the ring
// bit-identical to the gRPC calls (fp32, bf16); every record authorized against the token
// that opened the channel (an infer-only token cannot keep a step or run Backward through
// it); the bound on open channels; a channel attached by another pid than declared; a caller
// killed mid-step (a child process: this binary run again) leaves no channel thread, no
// mapping in moed and nothing in /dev/shm; and a moed without --allow_client_shm refuses.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/moe_client.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "tests/server/cluster_fixture.h"
#include "transport/ring_channel.h"
#include "transport/shm_object.h"
#include "transport/step_envelope.h"

namespace moe {
namespace {

constexpr uint8_t kForward = 1, kBackward = 2, kReleaseStep = 3;

void As(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
}

struct Opened {
  std::unique_ptr<RingChannel> ring;
  uint64_t id = 0;
};

// OpenStepChannel with `token`, then attach as `pid` declares (attached by this process).
absl::StatusOr<Opened> Open(v1::MoeService::Stub* stub, const std::string& token,
                            uint32_t pid = static_cast<uint32_t>(getpid())) {
  grpc::ClientContext ctx;
  As(&ctx, token);
  v1::OpenStepChannelRequest request;
  request.set_ring_bytes(1 << 20);
  request.set_caller_pid(pid);
  v1::OpenStepChannelResponse response;
  grpc::Status s = stub->OpenStepChannel(&ctx, request, &response);
  if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  if (!absl::StartsWith(response.name(), "/moed-ring-")) return absl::InternalError(response.name());
  absl::StatusOr<ShmObject> object = ShmObject::OpenNamed(response.name());
  if (!object.ok()) return object.status();
  absl::StatusOr<std::unique_ptr<RingChannel>> ring =
      RingChannel::Attach(std::move(*object), RingChannel::Role::kCaller);
  if (!ring.ok()) return ring.status();
  return Opened{std::move(*ring), response.channel_id()};
}

// One record: `kind`, 20 s, the request's bytes; the answer parsed into *response.
absl::Status Step(RingChannel& ring, uint8_t kind, const google::protobuf::Message& request,
                  google::protobuf::Message* response) {
  absl::StatusOr<std::string> answer = ring.Call(
      EncodeStepEnvelope(kind, absl::Seconds(20), request.SerializeAsString()),
      absl::Now() + absl::Seconds(30));
  if (!answer.ok()) return answer.status();
  if (!response->ParseFromString(*answer)) return absl::DataLossError("answer does not parse");
  return absl::OkStatus();
}

// A ReleaseStep of `step_id` on the test's layer.
v1::ReleaseStepRequest ReleaseOf(uint64_t step_id) {
  v1::ReleaseStepRequest release;
  release.set_layer("ring");
  release.set_step_id(step_id);
  return release;
}

// Threads of moed named "moed-ring" (one per open channel), its mappings of a ring, and
// the ring objects in /dev/shm.
int RingThreads(pid_t pid) {
  int n = 0;
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/task").c_str());
  if (dir == nullptr) return -1;
  while (dirent* entry = readdir(dir)) {
    std::ifstream comm(absl::StrCat("/proc/", pid, "/task/", entry->d_name, "/comm"));
    std::string name;
    if (std::getline(comm, name) && name == "moed-ring") ++n;
  }
  closedir(dir);
  return n;
}
bool MapsRing(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/maps"));
  std::string maps((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return maps.find("moed-ring-") != std::string::npos;
}
int RingObjects() {
  int n = 0;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  while (dirent* entry = readdir(dir)) n += absl::StartsWith(entry->d_name, "moed-ring-") ? 1 : 0;
  closedir(dir);
  return n;
}

// Whether `condition` holds within 10 s (polled: moed's channel threads start, name
// themselves and unlink their region's name on their own time).
bool Eventually(const std::function<bool()>& condition) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!condition()) {
    if (absl::Now() >= give_up) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// --- The child of CallerKilledMidStep: this binary again with
// MOED_STEP_CHANNEL_CHILD="<address> <token>". Opens a channel, sends a 2048-token Forward,
// says "ready" as soon as the record is out and waits to be killed.
void RunChildIfAsked() {
  const char* spec = std::getenv("MOED_STEP_CHANNEL_CHILD");
  if (spec == nullptr) return;
  char address[256], token[256];
  if (std::sscanf(spec, "%255s %255s", address, token) != 2) _exit(3);
  auto stub =
      v1::MoeService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  absl::StatusOr<Opened> opened = Open(stub.get(), token);
  if (!opened.ok()) _exit(4);
  v1::ForwardRequest request;
  request.set_layer("ring");
  request.set_keep_for_backward(true);
  *request.mutable_x() = FloatsToProto({2048, 32}, RandomFloats(2048 * 32, 9));
  std::thread call([&] {
    v1::ForwardResponse response;
    Step(*opened->ring, kForward, request, &response).IgnoreError();
  });
  absl::SleepFor(absl::Milliseconds(5));
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) pause();
}
const int kChildHook = (RunChildIfAsked(), 0);

class StepChannelTest : public ClusterTest {
 protected:
  static std::string TokensPath() { return ::testing::TempDir() + "/step_channel_tokens"; }
  static void WriteTokens(bool with_gone) {
    std::ofstream out(TokensPath());
    out << Sha256Hex("admin-token") << " admin admin\n"
        << Sha256Hex("infer-token") << " infer reader\n";
    if (with_gone) out << Sha256Hex("gone-token") << " train leaving\n";
  }
  static void SetUpTestSuite() {
    WriteTokens(/*with_gone=*/true);
    const std::string tokens = TokensPath();
    ClusterOptions options;
    options.workers = 2;
    options.moed_flags = {"--allow_client_shm", "--tokens_file=" + tokens,
                          "--max_step_channels=4", "--max_step_channels_per_client=0"};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
    grpc::ClientContext ctx;
    As(&ctx, "admin-token");
    v1::CreateLayerRequest create;
    create.set_name("ring");
    *create.mutable_config() = TinyConfig(5);
    v1::CreateLayerResponse created;
    grpc::Status s = cluster_->stub()->CreateLayer(&ctx, create, &created);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  // Waits up to 10 s until moed serves no channel (threads, mappings, /dev/shm).
  void ExpectNoChannels() {
    const pid_t moed = cluster_->moed_pid();
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (RingThreads(moed) != 0 || MapsRing(moed) || RingObjects() != 0) {
      ASSERT_LT(absl::Now(), give_up) << RingThreads(moed) << " ring threads, maps a ring: "
                                      << MapsRing(moed) << ", " << RingObjects()
                                      << " in /dev/shm";
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
};

void ExpectSameTensor(const v1::Tensor& a, const v1::Tensor& b) {
  EXPECT_EQ(a.datatype(), b.datatype());
  EXPECT_EQ(std::vector<int64_t>(a.shape().begin(), a.shape().end()),
            std::vector<int64_t>(b.shape().begin(), b.shape().end()));
  EXPECT_TRUE(a.raw_data() == b.raw_data()) << "bytes differ";
  EXPECT_FALSE(a.raw_data().empty());
}

TEST_F(StepChannelTest, ForwardBackwardReleaseBitIdenticalToGrpc) {
  absl::StatusOr<Opened> opened = Open(stub(), "admin-token");
  ASSERT_TRUE(opened.ok()) << opened.status();
  for (const char* dtype : {"FP32", "BF16"}) {
    SCOPED_TRACE(dtype);
    v1::Tensor x = FloatsToProto({16, 32}, RandomFloats(16 * 32, 1));
    v1::Tensor d_out = FloatsToProto({16, 32}, RandomFloats(16 * 32, 2));
    if (std::string(dtype) == "BF16") {
      x = FloatsToProto({16, 32}, RandomFloats(16 * 32, 1));
      absl::StatusOr<Tensor> t = TensorFromProto("x", x);
      ASSERT_TRUE(t.ok());
      TensorToProto(t->ConvertTo(DType::kBFloat16), &x);
      absl::StatusOr<Tensor> d = TensorFromProto("d_out", d_out);
      ASSERT_TRUE(d.ok());
      TensorToProto(d->ConvertTo(DType::kBFloat16), &d_out);
    }
    v1::ForwardRequest forward;
    forward.set_layer("ring");
    forward.set_keep_for_backward(true);
    *forward.mutable_x() = x;
    v1::ForwardResponse by_grpc, by_ring;
    {
      grpc::ClientContext ctx;
      As(&ctx, "admin-token");
      grpc::Status s = stub()->Forward(&ctx, forward, &by_grpc);
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    absl::Status s = Step(*opened->ring, kForward, forward, &by_ring);
    ASSERT_TRUE(s.ok()) << s;
    ExpectSameTensor(by_grpc.out(), by_ring.out());
    EXPECT_EQ(by_grpc.aux_loss(), by_ring.aux_loss());
    EXPECT_EQ(by_grpc.z_loss(), by_ring.z_loss());
    EXPECT_EQ(std::vector<int64_t>(by_grpc.tokens_per_expert().begin(),
                                   by_grpc.tokens_per_expert().end()),
              std::vector<int64_t>(by_ring.tokens_per_expert().begin(),
                                   by_ring.tokens_per_expert().end()));
    ASSERT_NE(by_ring.step_id(), 0u);
    ASSERT_NE(by_grpc.step_id(), by_ring.step_id());

    v1::BackwardRequest backward;
    backward.set_layer("ring");
    *backward.mutable_d_out() = d_out;
    v1::BackwardResponse back_grpc, back_ring;
    backward.set_step_id(by_grpc.step_id());
    {
      grpc::ClientContext ctx;
      As(&ctx, "admin-token");
      grpc::Status g = stub()->Backward(&ctx, backward, &back_grpc);
      ASSERT_TRUE(g.ok()) << g.error_message();
    }
    backward.set_step_id(by_ring.step_id());
    s = Step(*opened->ring, kBackward, backward, &back_ring);
    ASSERT_TRUE(s.ok()) << s;
    ExpectSameTensor(back_grpc.d_x(), back_ring.d_x());

    // The same errors as gRPC: the step is used.
    s = Step(*opened->ring, kBackward, backward, &back_ring);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    // ReleaseStep: a kept step is released once.
    v1::ForwardResponse kept;
    ASSERT_TRUE(Step(*opened->ring, kForward, forward, &kept).ok());
    const v1::ReleaseStepRequest release = ReleaseOf(kept.step_id());
    v1::ReleaseStepResponse released;
    ASSERT_TRUE(Step(*opened->ring, kReleaseStep, release, &released).ok());
    EXPECT_TRUE(released.released());
    ASSERT_TRUE(Step(*opened->ring, kReleaseStep, release, &released).ok());
    EXPECT_FALSE(released.released());
  }
  // Bad records: a missing layer, a bad kind, bytes that do not parse.
  v1::ForwardRequest missing;
  missing.set_layer("no-such-layer");
  *missing.mutable_x() = FloatsToProto({16, 32}, RandomFloats(16 * 32, 1));
  v1::ForwardResponse response;
  EXPECT_EQ(Step(*opened->ring, kForward, missing, &response).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Step(*opened->ring, 9, missing, &response).code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> garbage = opened->ring->Call(
      EncodeStepEnvelope(kForward, absl::Seconds(5), "\xff\xff\xff"), absl::Now() + absl::Seconds(10));
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument) << garbage.status();
  absl::StatusOr<std::string> short_record =
      opened->ring->Call("abc", absl::Now() + absl::Seconds(10));
  EXPECT_EQ(short_record.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StepChannelTest, EveryRecordIsAuthorizedAgainstTheOpeningToken) {
  // No token: the open is refused.
  EXPECT_EQ(Open(stub(), "").status().code(), absl::StatusCode::kUnauthenticated);
  absl::StatusOr<Opened> opened = Open(stub(), "infer-token");
  ASSERT_TRUE(opened.ok()) << opened.status();
  v1::ForwardRequest forward;
  forward.set_layer("ring");
  *forward.mutable_x() = FloatsToProto({16, 32}, RandomFloats(16 * 32, 3));
  v1::ForwardResponse response;
  absl::Status s = Step(*opened->ring, kForward, forward, &response);
  EXPECT_TRUE(s.ok()) << s;
  forward.set_keep_for_backward(true);
  s = Step(*opened->ring, kForward, forward, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "train")) << s;
  v1::BackwardRequest backward;
  backward.set_layer("ring");
  backward.set_step_id(1);
  *backward.mutable_d_out() = forward.x();
  v1::BackwardResponse back;
  EXPECT_EQ(Step(*opened->ring, kBackward, backward, &back).code(),
            absl::StatusCode::kPermissionDenied);
  const v1::ReleaseStepRequest release = ReleaseOf(1);
  v1::ReleaseStepResponse released;
  EXPECT_EQ(Step(*opened->ring, kReleaseStep, release, &released).code(),
            absl::StatusCode::kPermissionDenied);
  // Another identity cannot close it.
  grpc::ClientContext ctx;
  As(&ctx, "admin-token");
  v1::CloseStepChannelRequest close;
  close.set_channel_id(opened->id);
  v1::CloseStepChannelResponse closed;
  EXPECT_EQ(stub()->CloseStepChannel(&ctx, close, &closed).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(StepChannelTest, OpenChannelsAreBoundedAndCloseFreesThem) {
  ExpectNoChannels();
  std::vector<Opened> open;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<Opened> opened = Open(stub(), "admin-token");
    ASSERT_TRUE(opened.ok()) << i << ": " << opened.status();
    open.push_back(std::move(*opened));
  }
  absl::StatusOr<Opened> fifth = Open(stub(), "admin-token");
  EXPECT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted) << fifth.status();
  EXPECT_TRUE(absl::StrContains(fifth.status().message(), "--max_step_channels"));
  const pid_t moed = cluster_->moed_pid();
  EXPECT_TRUE(Eventually([&] { return RingThreads(moed) == 4; })) << RingThreads(moed);
  EXPECT_TRUE(Eventually([] { return RingObjects() == 0; }));  // unlinked once attached
  // CloseStepChannel: the caller then sees the server closed.
  grpc::ClientContext ctx;
  As(&ctx, "admin-token");
  v1::CloseStepChannelRequest close;
  close.set_channel_id(open[0].id);
  v1::CloseStepChannelResponse closed;
  ASSERT_TRUE(stub()->CloseStepChannel(&ctx, close, &closed).ok());
  EXPECT_TRUE(Eventually([&] { return !open[0].ring->PeerAlive(); }));  // moed's side closed
  const v1::ReleaseStepRequest release = ReleaseOf(12345);
  v1::ReleaseStepResponse released;
  absl::Status s = Step(*open[0].ring, kReleaseStep, release, &released);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  // The caller closing its side frees the rest.
  open.clear();
  ExpectNoChannels();
  absl::StatusOr<Opened> again = Open(stub(), "admin-token");
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST_F(StepChannelTest, AttachedByAnotherPidIsRefused) {
  absl::StatusOr<Opened> opened =
      Open(stub(), "admin-token", static_cast<uint32_t>(getpid()) + 100000);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const v1::ReleaseStepRequest release = ReleaseOf(1);
  v1::ReleaseStepResponse released;
  absl::Status s = Step(*opened->ring, kReleaseStep, release, &released);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  opened->ring.reset();
  ExpectNoChannels();
}

TEST_F(StepChannelTest, CallerKilledMidStepLeavesNothing) {
  ExpectNoChannels();
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const std::string spec = absl::StrCat(cluster_->address(), " admin-token");
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    dup2(out[1], STDOUT_FILENO);
    setenv("MOED_STEP_CHANNEL_CHILD", spec.c_str(), 1);
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) _exit(2);
    self[n] = '\0';
    execl(self, self, nullptr);
    _exit(2);
  }
  close(out[1]);
  char line[16] = {};
  ASSERT_GT(read(out[0], line, sizeof(line) - 1), 0);
  close(out[0]);
  EXPECT_EQ(std::string(line), "ready\n");
  const pid_t moed = cluster_->moed_pid();
  EXPECT_TRUE(Eventually([&] { return RingThreads(moed) == 1; })) << RingThreads(moed);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  ExpectNoChannels();
  // moed still serves: a new channel answers.
  absl::StatusOr<Opened> opened = Open(stub(), "admin-token");
  ASSERT_TRUE(opened.ok()) << opened.status();
  v1::ForwardRequest forward;
  forward.set_layer("ring");
  *forward.mutable_x() = FloatsToProto({16, 32}, RandomFloats(16 * 32, 4));
  v1::ForwardResponse response;
  EXPECT_TRUE(Step(*opened->ring, kForward, forward, &response).ok());
}

// The C++ client (client/step_channel.h) uses the channel by itself on moed's host: the same
// bytes as its gRPC calls, the same error codes, ReleaseStep too.
TEST_F(StepChannelTest, CppClientStepsOverTheChannelBitIdentically) {
  client::ClientOptions ring_options;
  ring_options.token = "admin-token";
  client::ClientOptions grpc_options = ring_options;
  grpc_options.step_channel = false;
  auto ring = client::MoeClient::Connect(cluster_->address(), ring_options);
  auto grpc = client::MoeClient::Connect(cluster_->address(), grpc_options);
  ASSERT_TRUE(ring.ok() && grpc.ok());
  const Tensor x = Tensor::FromFloats({16, 32}, RandomFloats(16 * 32, 11));
  const Tensor d_out = Tensor::FromFloats({16, 32}, RandomFloats(16 * 32, 12));
  std::vector<std::string> bytes[2];
  int i = 0;
  for (client::MoeClient* c : {ring->get(), grpc->get()}) {
    auto fwd = c->Forward("ring", x, /*keep_for_backward=*/true);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    auto d_x = c->Backward("ring", fwd->step_id, d_out);
    ASSERT_TRUE(d_x.ok()) << d_x.status();
    auto kept = c->Forward("ring", x, /*keep_for_backward=*/true);
    ASSERT_TRUE(kept.ok()) << kept.status();
    auto released = c->ReleaseStep("ring", kept->step_id);
    ASSERT_TRUE(released.ok() && *released);
    bytes[i++] = {std::string(fwd->out.bytes().data(), fwd->out.bytes().size()),
                  std::string(d_x->bytes().data(), d_x->bytes().size())};
    // The same error as gRPC: the step was used.
    EXPECT_EQ(c->Backward("ring", fwd->step_id, d_out).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(bytes[0], bytes[1]);
  EXPECT_EQ((*ring)->steps_over_channel(), 4u);  // fwd, bwd, fwd, release (not the error)
  EXPECT_TRUE((*ring)->step_channel_on());
  EXPECT_EQ((*grpc)->steps_over_channel(), 0u);
  // An infer-only token through the client's channel: refused as over gRPC.
  client::ClientOptions infer_options;
  infer_options.token = "infer-token";
  auto infer = client::MoeClient::Connect(cluster_->address(), infer_options);
  ASSERT_TRUE(infer.ok());
  EXPECT_TRUE((*infer)->Forward("ring", x).ok());
  EXPECT_EQ((*infer)->Forward("ring", x, true).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ((*infer)->steps_over_channel(), 1u);
}

// A SIGHUP reload that drops a token closes the channels it opened.
TEST_F(StepChannelTest, TokenReloadClosesTheChannelsOfARevokedToken) {
  ExpectNoChannels();
  absl::StatusOr<Opened> revoked = Open(stub(), "gone-token");
  ASSERT_TRUE(revoked.ok()) << revoked.status();
  absl::StatusOr<Opened> kept = Open(stub(), "admin-token");
  ASSERT_TRUE(kept.ok()) << kept.status();
  const pid_t moed = cluster_->moed_pid();
  ASSERT_TRUE(Eventually([&] { return RingThreads(moed) == 2; })) << RingThreads(moed);
  WriteTokens(/*with_gone=*/false);
  cluster_->NotifyMoed(SIGHUP);
  EXPECT_TRUE(Eventually([&] { return RingThreads(moed) == 1; })) << RingThreads(moed);
  const v1::ReleaseStepRequest release = ReleaseOf(777);
  v1::ReleaseStepResponse released;
  EXPECT_EQ(Step(*revoked->ring, kReleaseStep, release, &released).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(Step(*kept->ring, kReleaseStep, release, &released).ok());
  WriteTokens(/*with_gone=*/true);
  cluster_->NotifyMoed(SIGHUP);
}

// moed without --allow_client_shm: UNIMPLEMENTED naming the flag.
class StepChannelOffTest : public ClusterTest {};

TEST_F(StepChannelOffTest, RefusedWithoutAllowClientShm) {
  absl::StatusOr<Opened> opened = Open(stub(), "");
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kUnimplemented) << opened.status();
  EXPECT_TRUE(absl::StrContains(opened.status().message(), "--allow_client_shm"));
  EXPECT_EQ(RingObjects(), 0);
}

TEST_F(StepChannelOffTest, CppClientFallsBackToGrpc) {
  ASSERT_TRUE(Create("ring-off", TinyConfig(2)).ok());
  auto c = client::MoeClient::Connect(cluster_->address());
  ASSERT_TRUE(c.ok());
  const Tensor x = Tensor::FromFloats({4, 32}, RandomFloats(4 * 32, 1));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((*c)->Forward("ring-off", x).ok());
  EXPECT_FALSE((*c)->step_channel_on());
  EXPECT_EQ((*c)->steps_over_channel(), 0u);
}

}  // namespace
}  // namespace moe
