#include "server/auth.h"

#include <openssl/evp.h>

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "engine/file_util.h"

namespace moe {
namespace {

constexpr absl::string_view kRoleNames[] = {"read", "infer", "train", "admin"};

bool IsHex64(absl::string_view s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!absl::ascii_isxdigit(c)) return false;
  }
  return true;
}

}  // namespace

absl::string_view RoleName(Role role) { return kRoleNames[static_cast<int>(role)]; }

absl::StatusOr<Role> ParseRole(absl::string_view name) {
  for (int i = 0; i < 4; ++i) {
    if (name == kRoleNames[i]) return static_cast<Role>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown role \"", name, "\" (read, infer, train or admin)"));
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < length; ++i)
    absl::StrAppend(&hex, absl::Hex(digest[i], absl::kZeroPad2));
  return hex;
}

absl::StatusOr<std::map<std::string, TokenAuthenticator::Entry>> TokenAuthenticator::Parse(
    const std::string& path) {
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("--tokens_file: ", text.status().message()));
  }
  std::map<std::string, Entry> out;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens_file: ", path, ":", line_number, ": ", why,
                       " (expected: <sha256 hex of the token> <read|infer|train|admin> [name])"));
    };
    if (fields.size() < 2 || fields.size() > 3) return bad("wrong number of fields");
    if (!IsHex64(fields[0])) return bad("the first field is not 64 hex digits");
    absl::StatusOr<Role> role = ParseRole(fields[1]);
    if (!role.ok()) return bad(role.status().message());
    const std::string hash = absl::AsciiStrToLower(fields[0]);
    if (out.count(hash) != 0) return bad("the same token twice");
    out[hash] = Entry{*role, fields.size() == 3 ? std::string(fields[2]) : ""};
  }
  return out;
}

absl::StatusOr<std::unique_ptr<TokenAuthenticator>> TokenAuthenticator::Load(
    const std::string& path) {
  std::unique_ptr<TokenAuthenticator> auth(new TokenAuthenticator(path));
  absl::Status loaded = auth->Reload();
  if (!loaded.ok()) return loaded;
  return auth;
}

absl::Status TokenAuthenticator::Reload() {
  absl::StatusOr<std::map<std::string, Entry>> parsed = Parse(path_);
  if (!parsed.ok()) return parsed.status();
  absl::MutexLock lock(&mu_);
  by_hash_ = std::move(*parsed);
  return absl::OkStatus();
}

int TokenAuthenticator::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(by_hash_.size());
}

absl::Status TokenAuthenticator::Authorize(const grpc::ServerContextBase& context,
                                           Role needed) const {
  absl::StatusOr<std::string> hash = TokenHash(context);
  if (!hash.ok()) return hash.status();
  return AuthorizeHash(*hash, needed);
}

absl::StatusOr<std::string> TokenAuthenticator::TokenHash(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "missing credentials: send metadata \"authorization: Bearer <token>\" (moectl --token, "
        "$MOED_TOKEN)");
  }
  absl::string_view value(it->second.data(), it->second.size());
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return absl::UnauthenticatedError("authorization metadata is not \"Bearer <token>\"");
  }
  return Sha256Hex(absl::StripAsciiWhitespace(value));
}

absl::Status TokenAuthenticator::AuthorizeHash(const std::string& hash, Role needed) const {
  absl::MutexLock lock(&mu_);
  auto found = by_hash_.find(hash);
  if (found == by_hash_.end()) return absl::UnauthenticatedError("unknown bearer token");
  if (found->second.role < needed) {
    return absl::PermissionDeniedError(absl::StrCat(
        "token", found->second.name.empty() ? "" : absl::StrCat(" \"", found->second.name, "\""),
        " has role ", RoleName(found->second.role), "; this call needs ", RoleName(needed)));
  }
  return absl::OkStatus();
}

}  // namespace moe
