#include "cli/usage.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cli/version.h"

namespace moe {
namespace cli {
namespace {

constexpr size_t kHelpWidth = 92;  // columns of the wrapped flag descriptions

bool UnderFlagDirs(const Program& program, absl::string_view file) {
  for (const std::string& dir : program.flag_dirs) {
    // Bazel compiles with workspace-relative paths ("server/moed_main.cc"); allow a prefix.
    if (absl::StartsWith(file, dir) || absl::StrContains(file, absl::StrCat("/", dir))) {
      return true;
    }
  }
  return false;
}

// Appends `text` wrapped at kHelpWidth columns, every line indented by `indent`.
void AppendWrapped(absl::string_view text, absl::string_view indent, std::string* out) {
  std::string line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent.size() + line.size() + 1 + word.size() > kHelpWidth) {
      absl::StrAppend(out, indent, line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(out, indent, line, "\n");
}

bool IsHelpFlag(const char* arg) {
  return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-help") == 0;
}

// Flags Abseil's parser handles itself (usage and flag-file flags).
bool IsAbseilBuiltin(absl::string_view name) {
  for (const char* builtin :
       {"helpfull", "helpshort", "helppackage", "helpon", "helpmatch", "version", "only_check_args",
        "flagfile", "fromenv", "tryfromenv", "undefok"}) {
    if (name == builtin) return true;
  }
  return false;
}

[[noreturn]] void UsageErrorExit(const Program& program, absl::string_view message) {
  std::fprintf(stderr, "%s: %s\n(see %s --help)\n", program.name.c_str(),
               std::string(message).c_str(), program.name.c_str());
  std::exit(2);
}

// Abseil exits 1 on an unknown flag or a bad value; those are usage errors (exit 2). Checks
// what Abseil would refuse with the same rules ("--name=value", "--name value", "--bool",
// "--nobool", one or two dashes) before it parses; a good value set here is set again by it.
void CheckFlagsOrExit(int argc, char** argv, const Program& program) {
  for (int i = 1; i < argc; ++i) {
    // --undefok=a,b makes unknown flags legal: Abseil's own rules apply then.
    if (absl::StrContains(argv[i], "-undefok")) return;
  }
  for (int i = 1; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    absl::string_view arg = argv[i];
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t eq = arg.find('=');
    const absl::string_view name = arg.substr(0, eq);
    if (IsAbseilBuiltin(name)) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no") && eq == absl::string_view::npos) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) continue;
    }
    if (flag == nullptr) UsageErrorExit(program, absl::StrCat("unknown flag --", name));
    if (flag->IsRetired()) continue;
    absl::string_view value;
    if (eq != absl::string_view::npos) {
      value = arg.substr(eq + 1);
    } else if (flag->IsOfType<bool>()) {
      continue;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      UsageErrorExit(program, absl::StrCat("--", name, " needs a value"));
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      UsageErrorExit(program, absl::StrCat("--", name, "=", value, ": ", error));
    }
  }
}

}  // namespace

const char* Version() { return MOED_VERSION; }

std::string HelpText(const Program& program) {
  std::string out = absl::StrCat(program.name, ": ", program.usage);
  if (!absl::EndsWith(out, "\n")) out += "\n";
  out += "\nflags:\n";
  std::map<absl::string_view, const absl::CommandLineFlag*> flags;  // sorted by name
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!flag->IsRetired() && UnderFlagDirs(program, flag->Filename())) flags[name] = flag;
  }
  for (const auto& [name, flag] : flags) {
    std::string default_value = flag->DefaultValue();
    if (default_value.empty() && flag->IsOfType<std::string>()) default_value = "\"\"";
    absl::StrAppend(&out, "  --", name, "=", default_value, "\n");
    AppendWrapped(flag->Help(), "      ", &out);
  }
  out += "\n  --help prints this, --version the version; --helpfull adds Abseil's own flags.\n";
  return out;
}

std::vector<char*> ParseCommandLine(int argc, char** argv, const Program& program) {
  absl::SetProgramUsageMessage(program.usage);
  absl::FlagsUsageConfig config;
  // For Abseil's --helpshort/--helpon: the same files as --help here.
  config.contains_help_flags = [dirs = program.flag_dirs](absl::string_view file) {
    return UnderFlagDirs({"", "", dirs}, file);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.version_string = [name = program.name] {
    return absl::StrCat(name, " ", Version(), "\n");
  };
  absl::SetFlagsUsageConfig(config);
  for (int i = 1; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    if (IsHelpFlag(argv[i])) {
      const std::string help = HelpText(program);
      std::fwrite(help.data(), 1, help.size(), stdout);
      std::fflush(stdout);
      std::exit(0);
    }
  }
  CheckFlagsOrExit(argc, argv, program);
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace cli
}  // namespace moe
