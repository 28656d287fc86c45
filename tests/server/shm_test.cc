// Client shared memory (proto/moe.proto "Shared memory") against moed + 2 real moe-workers
// started with --allow_client_shm: register / status / unregister, Forward and Backward
// bit-identical to the gRPC path (fp32, bf16), bad ranges, a region unregistered while a step
// uses it, and clients killed while their region is registered (a child process).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/shared_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/cluster_fixture.h"

namespace moe {
namespace {

using client::SharedMemoryRegion;
using ::testing::HasSubstr;

// --- The child process of the killed-client tests: this binary run again with
// MOED_SHM_TEST_CHILD="<address> <key> <name>". It creates and registers a region, runs one
// Forward through it, says "ready" on stdout, then waits to be killed.
void RunChildIfAsked() {
  const char* spec = std::getenv("MOED_SHM_TEST_CHILD");
  if (spec == nullptr) return;
  char address[256], key[256], name[256];
  if (std::sscanf(spec, "%255s %255s %255s", address, key, name) != 3) _exit(3);
  const int fd = shm_open(key, O_RDWR | O_CREAT | O_EXCL, 0600);  // never unlinked by us
  if (fd < 0 || ftruncate(fd, 1 << 16) != 0) _exit(4);
  close(fd);
  auto stub =
      v1::MoeService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::RegisterSystemSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_byte_size(1 << 16);
  v1::RegisterSystemSharedMemoryResponse response;
  if (!stub->RegisterSystemSharedMemory(&ctx, request, &response).ok()) _exit(5);
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) pause();
}
const int kChildHook = (RunChildIfAsked(), 0);

// Lines of /proc/<pid>/maps naming /dev/shm<key>.
bool Maps(pid_t pid, const std::string& key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/maps"));
  std::string maps((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return maps.find("/dev/shm" + key) != std::string::npos;
}

std::string UniqueKey(const std::string& what) {
  static int counter = 0;
  return absl::StrCat("/moed-shm-test-", getpid(), "-", what, "-", counter++);
}

template <int kIdleTimeoutS>
class ShmClusterTest : public ClusterTest {
 protected:
  static void SetUpTestSuite() {
    ClusterOptions options;
    options.workers = 2;
    // Long liveness and collective bounds: UnregisterWhileInUse stops a worker for a moment.
    options.moed_flags = {"--allow_client_shm", "--worker_dead_after_ms=60000",
                          "--collective_timeout_ms=60000", "--step_timeout_ms=60000",
                          absl::StrCat("--shm_idle_timeout_s=", kIdleTimeoutS)};
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }

  grpc::Status Register(const std::string& name, const std::string& key, int64_t offset,
                        int64_t byte_size) {
    grpc::ClientContext ctx;
    v1::RegisterSystemSharedMemoryRequest request;
    request.set_name(name);
    request.set_key(key);
    request.set_offset(offset);
    request.set_byte_size(byte_size);
    v1::RegisterSystemSharedMemoryResponse response;
    return stub()->RegisterSystemSharedMemory(&ctx, request, &response);
  }
  grpc::Status Unregister(const std::string& name) {
    grpc::ClientContext ctx;
    v1::UnregisterSystemSharedMemoryRequest request;
    request.set_name(name);
    v1::UnregisterSystemSharedMemoryResponse response;
    return stub()->UnregisterSystemSharedMemory(&ctx, request, &response);
  }
  grpc::Status Status(const std::string& name, v1::SystemSharedMemoryStatusResponse* response) {
    grpc::ClientContext ctx;
    v1::SystemSharedMemoryStatusRequest request;
    request.set_name(name);
    return stub()->SystemSharedMemoryStatus(&ctx, request, response);
  }
  // Waits (up to 60 s) until `name` is no longer registered and no process maps `key`.
  void ExpectDropped(const std::string& name, const std::string& key) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    v1::SystemSharedMemoryStatusResponse status;
    while (Status(name, &status).error_code() != grpc::StatusCode::NOT_FOUND) {
      ASSERT_LT(absl::Now(), give_up) << name << " still registered";
      absl::SleepFor(absl::Milliseconds(50));
    }
    for (int r = 0; r < 2; ++r) {
      while (Maps(cluster_->worker_pid(r), key)) {
        ASSERT_LT(absl::Now(), give_up) << "worker " << r << " still maps " << key;
        absl::SleepFor(absl::Milliseconds(50));
      }
    }
  }
};

using ShmTest = ShmClusterTest<600>;
using ShmIdleTest = ShmClusterTest<1>;

v1::SharedMemoryTensor ShmTensor(const std::string& region, int64_t offset, const char* datatype,
                                 int64_t tokens, int64_t hidden) {
  v1::SharedMemoryTensor t;
  t.set_region(region);
  t.set_offset(offset);
  t.set_datatype(datatype);
  t.add_shape(tokens);
  t.add_shape(hidden);
  t.set_byte_size(tokens * hidden * (std::string(datatype) == "BF16" ? 2 : 4));
  return t;
}

v1::SharedMemoryOutput ShmOutput(const std::string& region, int64_t offset, int64_t byte_size) {
  v1::SharedMemoryOutput o;
  o.set_region(region);
  o.set_offset(offset);
  o.set_byte_size(byte_size);
  return o;
}

TEST_F(ShmTest, RegisterStatusUnregister) {
  const std::string key = UniqueKey("reg");
  auto shm = SharedMemoryRegion::Create(key, 1 << 16);
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(Register("r1", key, 4096, 8192).ok());
  EXPECT_EQ(Register("r1", key, 0, 16).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  v1::SystemSharedMemoryStatusResponse status;
  ASSERT_TRUE(Status("r1", &status).ok());
  ASSERT_EQ(status.regions_size(), 1);
  EXPECT_EQ(status.regions(0).key(), key);
  EXPECT_EQ(status.regions(0).offset(), 4096);
  EXPECT_EQ(status.regions(0).byte_size(), 8192);
  EXPECT_EQ(status.regions(0).steps_in_flight(), 0);
  EXPECT_EQ(Status("nope", &status).error_code(), grpc::StatusCode::NOT_FOUND);

  EXPECT_EQ(Register("missing", UniqueKey("missing"), 0, 16).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Register("badkey", "no-slash", 0, 16).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("badkey", "/a/b", 0, 16).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("bad name", key, 0, 16).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("big", key, 0, (1 << 16) + 1).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("big", key, 1 << 16, 1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("neg", key, -1, 16).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("zero", key, 0, 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("overflow", key, INT64_MAX, 2).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  ASSERT_TRUE(Register("r2", key, 0, 16).ok());
  ASSERT_TRUE(Status("", &status).ok());
  EXPECT_EQ(status.regions_size(), 2);
  ASSERT_TRUE(Unregister("r1").ok());
  EXPECT_EQ(Unregister("r1").error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(Unregister("").ok());  // all
  status.Clear();
  ASSERT_TRUE(Status("", &status).ok());
  EXPECT_EQ(status.regions_size(), 0);
}

// A CUDA region cannot be registered while the workers run on the CPU: FAILED_PRECONDITION
// naming the reason, and nothing is registered.
TEST_F(ShmTest, CudaRegionNeedsCudaWorkers) {
  grpc::ClientContext ctx;
  v1::RegisterCudaSharedMemoryRequest request;
  request.set_name("gpu");
  request.set_raw_handle(std::string(64, '\x01'));
  request.set_device_id(0);
  request.set_byte_size(1 << 20);
  v1::RegisterCudaSharedMemoryResponse response;
  grpc::Status s = stub()->RegisterCudaSharedMemory(&ctx, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("CUDA workers"));
  v1::SystemSharedMemoryStatusResponse status;
  EXPECT_EQ(Status("gpu", &status).error_code(), grpc::StatusCode::NOT_FOUND);
}

// Forward + Backward through shared memory give the gRPC path's bytes exactly.
TEST_F(ShmTest, BitIdenticalToGrpc) {
  ASSERT_TRUE(Create("bits", TinyConfig(7)).ok());
  const int64_t tokens = 37, hidden = 32;
  for (const char* datatype : {"FP32", "BF16"}) {
    SCOPED_TRACE(datatype);
    v1::Tensor x = FloatsToProto({tokens, hidden}, RandomFloats(tokens * hidden, 11));
    v1::Tensor d_out = FloatsToProto({tokens, hidden}, RandomFloats(tokens * hidden, 12));
    if (std::string(datatype) == "BF16") {
      auto to_bf16 = [](const v1::Tensor& t) {
        v1::Tensor out;
        TensorToProto(TensorFromProto("t", t)->ConvertTo(DType::kBFloat16), &out);
        return out;
      };
      x = to_bf16(x);
      d_out = to_bf16(d_out);
    }
    const int64_t bytes = x.raw_data().size();
    v1::ForwardResponse grpc_fwd;
    ASSERT_TRUE(Forward("bits", x, true, &grpc_fwd).ok());
    v1::BackwardResponse grpc_bwd;
    ASSERT_TRUE(Backward("bits", grpc_fwd.step_id(), d_out, &grpc_bwd).ok());

    const std::string key = UniqueKey(datatype);
    auto shm = SharedMemoryRegion::Create(key, 4 * bytes + 64);
    ASSERT_TRUE(shm.ok()) << shm.status();
    char* base = (*shm)->data() + 64;  // the region starts 64 bytes into the object
    std::memcpy(base, x.raw_data().data(), bytes);
    std::memcpy(base + 2 * bytes, d_out.raw_data().data(), bytes);
    ASSERT_TRUE(Register("io", key, 64, 4 * bytes).ok());

    grpc::ClientContext fctx;
    v1::ForwardRequest freq;
    freq.set_layer("bits");
    *freq.mutable_x_shm() = ShmTensor("io", 0, datatype, tokens, hidden);
    *freq.mutable_out_shm() = ShmOutput("io", bytes, bytes);
    freq.set_keep_for_backward(true);
    v1::ForwardResponse fwd;
    ASSERT_TRUE(stub()->Forward(&fctx, freq, &fwd).ok());
    EXPECT_TRUE(fwd.out().raw_data().empty());
    EXPECT_EQ(fwd.out().datatype(), datatype);
    EXPECT_EQ(std::string(base + bytes, bytes), grpc_fwd.out().raw_data());
    EXPECT_EQ(fwd.aux_loss(), grpc_fwd.aux_loss());
    EXPECT_EQ(fwd.z_loss(), grpc_fwd.z_loss());
    EXPECT_THAT(fwd.tokens_per_expert(), ::testing::ElementsAreArray(grpc_fwd.tokens_per_expert()));

    grpc::ClientContext bctx;
    v1::BackwardRequest breq;
    breq.set_layer("bits");
    breq.set_step_id(fwd.step_id());
    *breq.mutable_d_out_shm() = ShmTensor("io", 2 * bytes, datatype, tokens, hidden);
    *breq.mutable_d_x_shm() = ShmOutput("io", 3 * bytes, bytes);
    v1::BackwardResponse bwd;
    ASSERT_TRUE(stub()->Backward(&bctx, breq, &bwd).ok());
    EXPECT_TRUE(bwd.d_x().raw_data().empty());
    EXPECT_EQ(std::string(base + 3 * bytes, bytes), grpc_bwd.d_x().raw_data());

    // Mixed: x in the message, out in the region (and the reverse) give the same bytes.
    std::memset(base + bytes, 0, bytes);
    grpc::ClientContext mctx;
    v1::ForwardRequest mixed;
    mixed.set_layer("bits");
    *mixed.mutable_x() = x;
    *mixed.mutable_out_shm() = ShmOutput("io", bytes, bytes);
    ASSERT_TRUE(stub()->Forward(&mctx, mixed, &fwd).ok());
    EXPECT_EQ(std::string(base + bytes, bytes), grpc_fwd.out().raw_data());
    grpc::ClientContext mctx2;
    mixed.clear_out_shm();
    *mixed.mutable_x_shm() = ShmTensor("io", 0, datatype, tokens, hidden);
    ASSERT_TRUE(stub()->Forward(&mctx2, mixed, &fwd).ok());
    EXPECT_EQ(fwd.out().raw_data(), grpc_fwd.out().raw_data());
    ASSERT_TRUE(Unregister("io").ok());
  }
}

TEST_F(ShmTest, BadReferencesGetTheirCodes) {
  ASSERT_TRUE(Create("badref", TinyConfig(3)).ok());
  const std::string key = UniqueKey("bad");
  auto shm = SharedMemoryRegion::Create(key, 1 << 16);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(Register("bad", key, 0, 4096).ok());
  auto forward = [&](const v1::SharedMemoryTensor& x, const v1::SharedMemoryOutput* out) {
    grpc::ClientContext ctx;
    v1::ForwardRequest request;
    request.set_layer("badref");
    *request.mutable_x_shm() = x;
    if (out != nullptr) *request.mutable_out_shm() = *out;
    v1::ForwardResponse response;
    return stub()->Forward(&ctx, request, &response);
  };
  const auto x = ShmTensor("bad", 0, "FP32", 8, 32);  // 1024 bytes
  EXPECT_TRUE(forward(x, nullptr).ok());
  auto with = [&](auto edit) {
    v1::SharedMemoryTensor t = x;
    edit(&t);
    return forward(t, nullptr);
  };
  EXPECT_EQ(with([](auto* t) { t->set_region("unknown"); }).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(with([](auto* t) { t->set_offset(3072 + 4); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);  // past the region's end
  EXPECT_EQ(with([](auto* t) { t->set_offset(-4); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  grpc::Status misaligned = with([](auto* t) { t->set_offset(2); });
  EXPECT_EQ(misaligned.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(misaligned.error_message(), HasSubstr("x_shm.offset"));
  EXPECT_EQ(with([](auto* t) { t->set_byte_size(1020); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(with([](auto* t) { t->set_shape(0, INT64_MAX / 64); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);  // overflows
  EXPECT_EQ(with([](auto* t) { t->set_offset(INT64_MAX - 3); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(with([](auto* t) { t->set_shape(1, 16); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(with([](auto* t) { t->set_datatype("INT32"); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  const v1::SharedMemoryOutput small = ShmOutput("bad", 1024, 1020);
  EXPECT_EQ(forward(x, &small).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const v1::SharedMemoryOutput overlap = ShmOutput("bad", 512, 1024);
  EXPECT_EQ(forward(x, &overlap).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const v1::SharedMemoryOutput beyond = ShmOutput("bad", 3584, 1024);
  EXPECT_EQ(forward(x, &beyond).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const v1::SharedMemoryOutput unaligned = ShmOutput("bad", 1026, 1024);
  EXPECT_EQ(forward(x, &unaligned).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const v1::SharedMemoryOutput unknown = ShmOutput("unknown", 1024, 1024);
  EXPECT_EQ(forward(x, &unknown).error_code(), grpc::StatusCode::NOT_FOUND);
  const v1::SharedMemoryOutput good = ShmOutput("bad", 1024, 2048);  // larger is fine
  EXPECT_TRUE(forward(x, &good).ok());

  // A Backward whose d_x does not fit is refused before it uses the step.
  v1::ForwardResponse fwd;
  ASSERT_TRUE(Forward("badref", FloatsToProto({8, 32}, RandomFloats(256, 1)), true, &fwd).ok());
  grpc::ClientContext bctx;
  v1::BackwardRequest breq;
  breq.set_layer("badref");
  breq.set_step_id(fwd.step_id());
  *breq.mutable_d_out() = FloatsToProto({8, 32}, RandomFloats(256, 2));
  *breq.mutable_d_x_shm() = small;
  v1::BackwardResponse bwd;
  EXPECT_EQ(stub()->Backward(&bctx, breq, &bwd).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext bctx2;
  *breq.mutable_d_x_shm() = good;
  EXPECT_TRUE(stub()->Backward(&bctx2, breq, &bwd).ok());
  ASSERT_TRUE(Unregister("bad").ok());
  EXPECT_EQ(forward(x, nullptr).error_code(), grpc::StatusCode::NOT_FOUND);
}

// Unregistering while a step uses the region: the step finishes with its mapping, later steps
// get NOT_FOUND, and the workers unmap the region once the step is done.
TEST_F(ShmTest, UnregisterWhileInUse) {
  ASSERT_TRUE(Create("midstep", TinyConfig(5)).ok());
  const int64_t tokens = 16, hidden = 32, bytes = tokens * hidden * 4;
  v1::Tensor x = FloatsToProto({tokens, hidden}, RandomFloats(tokens * hidden, 21));
  v1::ForwardResponse grpc_fwd;
  ASSERT_TRUE(Forward("midstep", x, false, &grpc_fwd).ok());
  const std::string key = UniqueKey("mid");
  auto shm = SharedMemoryRegion::Create(key, 2 * bytes);
  ASSERT_TRUE(shm.ok());
  std::memcpy((*shm)->data(), x.raw_data().data(), bytes);
  ASSERT_TRUE(Register("mid", key, 0, 2 * bytes).ok());

  ASSERT_TRUE(cluster_->KillWorker(1, SIGSTOP));  // the step waits for it
  grpc::Status step_status;
  std::thread step([&] {
    grpc::ClientContext ctx;
    v1::ForwardRequest request;
    request.set_layer("midstep");
    *request.mutable_x_shm() = ShmTensor("mid", 0, "FP32", tokens, hidden);
    *request.mutable_out_shm() = ShmOutput("mid", bytes, bytes);
    v1::ForwardResponse response;
    step_status = stub()->Forward(&ctx, request, &response);
  });
  v1::SystemSharedMemoryStatusResponse status;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  // The step acquires x's and out's references one after the other: wait for both.
  while (Status("mid", &status).ok() && status.regions(0).steps_in_flight() < 2 &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(status.regions(0).steps_in_flight(), 2);  // x and out
  ASSERT_TRUE(Unregister("mid").ok());
  EXPECT_EQ(Status("mid", &status).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx;
  v1::ForwardRequest request;
  request.set_layer("midstep");
  *request.mutable_x_shm() = ShmTensor("mid", 0, "FP32", tokens, hidden);
  v1::ForwardResponse response;
  EXPECT_EQ(stub()->Forward(&ctx, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);

  ASSERT_TRUE(cluster_->KillWorker(1, SIGCONT));
  step.join();
  ASSERT_TRUE(step_status.ok()) << step_status.error_message();
  EXPECT_EQ(std::string((*shm)->data() + bytes, bytes), grpc_fwd.out().raw_data());
  ExpectDropped("mid", key);
}

// Runs the child (RunChildIfAsked) that registers `name` over `key` and is then SIGKILLed.
void RegisterFromKilledChild(const std::string& address, const std::string& key,
                             const std::string& name) {
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const std::string spec = absl::StrCat(address, " ", key, " ", name);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(out[1], 1);
    setenv("MOED_SHM_TEST_CHILD", spec.c_str(), 1);
    execl("/proc/self/exe", "shm_test_child", nullptr);
    _exit(127);
  }
  close(out[1]);
  char line[16] = {};
  const ssize_t n = read(out[0], line, sizeof(line) - 1);
  close(out[0]);
  kill(pid, SIGKILL);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  ASSERT_GT(n, 0) << "child exited with " << wstatus;
  ASSERT_EQ(std::string(line, n), "ready\n");
}

// A client killed while its region is registered, which a cleaner (Python's resource
// tracker, a job's epilogue) unlinks: moed drops the region and nothing stays mapped.
TEST_F(ShmTest, KilledClientsUnlinkedRegionIsDropped) {
  const std::string key = UniqueKey("killed");
  RegisterFromKilledChild(cluster_->address(), key, "killed");
  v1::SystemSharedMemoryStatusResponse status;
  ASSERT_TRUE(Status("killed", &status).ok());  // nothing unlinked it yet: still registered
  // A step maps it on the workers.
  ASSERT_TRUE(Create("killed-layer", TinyConfig(2)).ok());
  grpc::ClientContext ctx;
  v1::ForwardRequest request;
  request.set_layer("killed-layer");
  *request.mutable_x_shm() = ShmTensor("killed", 0, "FP32", 4, 32);
  v1::ForwardResponse response;
  ASSERT_TRUE(stub()->Forward(&ctx, request, &response).ok());
  EXPECT_TRUE(Maps(cluster_->worker_pid(0), key) || Maps(cluster_->worker_pid(1), key));
  shm_unlink(key.c_str());
  ExpectDropped("killed", key);
}

// The same client, but nobody unlinks the object: moed drops it after --shm_idle_timeout_s.
TEST_F(ShmIdleTest, KilledClientsIdleRegionIsDropped) {
  const std::string key = UniqueKey("idle");
  RegisterFromKilledChild(cluster_->address(), key, "idle");
  ExpectDropped("idle", key);
  shm_unlink(key.c_str());
}

}  // namespace
}  // namespace moe
