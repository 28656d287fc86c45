// moectl's usage and local errors that must come before any allocation or RPC: an unbounded
// --tokens, an unknown flag or a bad value is refused with exit code 2 and a message naming the
// flag; a missing --input file is a local error. No server is needed (the address given is
// never reached, or refuses the connection).
//
//   moectl_usage_test <path of moectl>
#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

std::string g_moectl;

// Runs moectl with `flags`; returns its exit code and puts stdout+stderr in *output.
int RunMoectl(const std::string& flags, std::string* output) {
  const std::string command = g_moectl + " " + flags + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output->append(buffer, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(MoectlUsageTest, HugeTokensIsAUsageError) {
  for (const char* command : {"smoke", "bench"}) {
    SCOPED_TRACE(command);
    std::string output;
    // 2^40 tokens x hidden 64 x 4 bytes: would be 256 TiB to allocate (larger inputs than
    // one message are streamed; this host's memory is the bound).
    const int code = RunMoectl(std::string(command) +
                                   " --server=127.0.0.1:1 --deadline_ms=2000 --hidden=64 "
                                   "--tokens=1099511627776 --progress=off",
                               &output);
    EXPECT_EQ(code, 2) << output;
    EXPECT_THAT(output, ::testing::HasSubstr("--tokens=1099511627776"));
    EXPECT_THAT(output, ::testing::HasSubstr("host's memory"));
  }
  // Negative is a usage error too; a sane count passes the check (and then fails to connect).
  std::string output;
  EXPECT_EQ(RunMoectl("smoke --server=127.0.0.1:1 --tokens=-1", &output), 2) << output;
  output.clear();
  EXPECT_EQ(
      RunMoectl("smoke --server=127.0.0.1:1 --deadline_ms=2000 --hidden=64 --tokens=8", &output), 1)
      << output;
}

TEST(MoectlUsageTest, UnknownFlagOrBadValueIsAUsageError) {
  std::string output;
  EXPECT_EQ(RunMoectl("health --bogus", &output), 2) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("unknown flag --bogus"));
  output.clear();
  EXPECT_EQ(RunMoectl("smoke --tokens=abc", &output), 2) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("--tokens=abc"));
  output.clear();
  EXPECT_EQ(RunMoectl("smoke --tokens", &output), 2) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("--tokens needs a value"));
  output.clear();
  EXPECT_EQ(RunMoectl("create-layer --gated=maybe", &output), 2) << output;
}

TEST(MoectlUsageTest, MissingInputFileIsALocalError) {
  // --input is read before any RPC; the answer must not look like the server's NOT_FOUND.
  std::string output;
  EXPECT_EQ(RunMoectl("forward --server=127.0.0.1:1 --layer=l --input=/nonexistent/x.npy", &output),
            1)
      << output;
  EXPECT_THAT(output, ::testing::HasSubstr("moectl forward: --input: cannot open"));
  EXPECT_THAT(output, ::testing::Not(::testing::HasSubstr("NOT_FOUND")));
}

TEST(MoectlUsageTest, ServerWithoutPortUsesTheDefaultPort) {
  // Nothing should listen on 127.0.0.1:50051 here; if something does, health may even pass.
  // Either way the port tried is 50051, never gRPC's https default 443.
  std::string output;
  const int code = RunMoectl("health --server=127.0.0.1 --deadline_ms=2000", &output);
  EXPECT_THAT(output, ::testing::Not(::testing::HasSubstr(":443")));
  if (code != 0) {
    EXPECT_THAT(output, ::testing::HasSubstr("127.0.0.1:50051"));
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: moectl_usage_test <moectl>\n");
    return 2;
  }
  g_moectl = argv[1];
  return RUN_ALL_TESTS();
}
