// --help and --version of the three binaries (moed, moe-worker, moectl): exit code 0, the
// usage line, the binary's own flags (and no Abseil-internal ones), no "No flags matched.",
// and the version from the VERSION file. Nothing is started: both flags exit before any work.
//
//   binary_usage_test <VERSION> <moed> <moe-worker> <moectl>
#include <sys/wait.h>

#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string g_version;
std::string g_moed, g_worker, g_moectl;

struct Result {
  int code = -1;
  std::string output;  // stdout and stderr
};

Result RunBinary(const std::string& binary, const std::string& flags) {
  Result run;
  FILE* pipe = popen((binary + " " + flags + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) run.output.append(buffer, n);
  const int status = pclose(pipe);
  run.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

struct Binary {
  const std::string* path;
  const char* name;
  const char* usage_line;
  std::vector<const char*> flags;  // some of its own flags, as --help shows them
};

std::vector<Binary> Binaries() {
  return {
      {&g_moed, "moed", "usage: moed ", {"--workers=0", "--port=50051", "--max_message_bytes="}},
      {&g_worker,
       "moe-worker",
       "usage: moe-worker --frontend=HOST:PORT",
       {"--frontend=\"\"", "--device=cpu", "--rank=-1"}},
      // Flags from several of moectl's files: main, layer flags, smoke.
      {&g_moectl, "moectl", "usage: moectl <command>", {"--server=", "--hidden=", "--rtol="}},
  };
}

TEST(BinaryUsageTest, HelpPrintsUsageAndFlagsAndExitsZero) {
  for (const Binary& b : Binaries()) {
    for (const char* help : {"--help", "-help"}) {
      SCOPED_TRACE(std::string(b.name) + " " + help);
      const Result run = RunBinary(*b.path, help);
      EXPECT_EQ(run.code, 0) << run.output;
      EXPECT_THAT(run.output, HasSubstr(std::string(b.name) + ": "));
      EXPECT_THAT(run.output, HasSubstr(b.usage_line));
      for (const char* flag : b.flags) EXPECT_THAT(run.output, HasSubstr(flag));
      EXPECT_THAT(run.output, Not(HasSubstr("No flags matched")));
      EXPECT_THAT(run.output, Not(HasSubstr("SetProgramUsageMessage")));  // Abseil's warning
      EXPECT_THAT(run.output, Not(HasSubstr("--flagfile")));              // Abseil's own flags
    }
  }
}

TEST(BinaryUsageTest, HelpWinsOverOtherFlags) {
  // Also after a command (moectl) and next to a flag that would fail.
  Result run = RunBinary(g_moectl, "smoke --tokens=-1 --help");
  EXPECT_EQ(run.code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("usage: moectl"));
  run = RunBinary(g_worker, "--rank=x --help");
  EXPECT_EQ(run.code, 0) << run.output;
}

TEST(BinaryUsageTest, VersionPrintsTheBuildVersionAndExitsZero) {
  for (const Binary& b : Binaries()) {
    SCOPED_TRACE(b.name);
    const Result run = RunBinary(*b.path, "--version");
    EXPECT_EQ(run.code, 0) << run.output;
    EXPECT_EQ(run.output, std::string(b.name) + " " + g_version + "\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 5) {
    std::fprintf(stderr, "usage: binary_usage_test <VERSION> <moed> <moe-worker> <moectl>\n");
    return 2;
  }
  std::ifstream version_file(argv[1]);
  std::stringstream version;
  version << version_file.rdbuf();
  g_version = version.str();
  while (!g_version.empty() && std::isspace(static_cast<unsigned char>(g_version.back()))) {
    g_version.pop_back();
  }
  g_moed = argv[2];
  g_worker = argv[3];
  g_moectl = argv[4];
  return RUN_ALL_TESTS();
}
