// --help and --version of the project's binaries (moed, moe-worker, moectl), done once.
//
// Abseil's own --help lists only the flags of files named like the program (moe-worker's
// flags live in worker_main.cc, so it printed "No flags matched.") and exits 1. Here --help
// prints the program's usage message and the flags defined under its source directories to
// stdout and exits 0; --version prints "<program> <version>" (the VERSION file at the root)
// and exits 0; an unknown flag or a bad value is a usage error, exit 2 (Abseil: 1). Parsing
// stays Abseil's (--helpfull, --flagfile work as usual).
//
//   int main(int argc, char** argv) {
//     std::vector<char*> positional =
//         moe::cli::ParseCommandLine(argc, argv, {"moed", kUsage, {"server/"}});
//     ...
#ifndef MOED_CLI_USAGE_H_
#define MOED_CLI_USAGE_H_

#include <string>
#include <vector>

namespace moe {
namespace cli {

struct Program {
  std::string name;  // as typed by users: "moed", "moe-worker", "moectl"
  // What the program is, then its "usage:" line(s); printed after "<name>: ".
  std::string usage;
  // --help lists the flags defined in files under these directories ("server/").
  std::vector<std::string> flag_dirs;
};

// The release version, from the VERSION file at the repository root ("0.1.0").
const char* Version();

// absl::ParseCommandLine with the program's usage message and version set first. --help
// (or -help) anywhere before a "--" prints the help and exits 0, before any other flag is
// looked at; --version exits 0 after printing the version; an unknown flag, a missing or bad
// value prints "<name>: <what>" to stderr and exits 2. Returns the positional arguments
// (argv[0] first).
std::vector<char*> ParseCommandLine(int argc, char** argv, const Program& program);

// The text --help prints: "<name>: <usage>" and the program's flags with their defaults.
std::string HelpText(const Program& program);

}  // namespace cli
}  // namespace moe

#endif  // MOED_CLI_USAGE_H_
