// One interface for Gloo and NCCL, in NCCL_SOCKET_IFNAME's conventions (server/socket_ifname.h).
#include "server/socket_ifname.h"

#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace moe {
namespace {

struct Spec {
  bool exclude = false;  // '^': the interfaces matching none of the names
  bool exact = false;    // '=': whole names, not prefixes
  std::vector<std::string> names;
};

Spec Parse(absl::string_view spec) {
  Spec s;
  if (absl::ConsumePrefix(&spec, "^")) s.exclude = true;
  if (absl::ConsumePrefix(&spec, "=")) s.exact = true;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    part = part.substr(0, part.find(':'));  // "eth0:1234": NCCL ignores the port here
    if (!part.empty()) s.names.emplace_back(part);
  }
  return s;
}

}  // namespace

absl::Status CheckSocketIfname(absl::string_view spec) {
  for (char c : spec) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--socket_ifname=\"", spec, "\": no spaces (a comma-separated list of interface names "
          "or prefixes, NCCL_SOCKET_IFNAME's conventions)"));
    }
  }
  if (Parse(spec).names.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--socket_ifname=\"", spec, "\" names no interface (e.g. eth0, =eth0, ib,eth or "
        "^docker,lo: NCCL_SOCKET_IFNAME's conventions)"));
  }
  return absl::OkStatus();
}

bool SocketIfnameMatches(absl::string_view spec, absl::string_view name) {
  const Spec s = Parse(spec);
  const bool listed = std::any_of(s.names.begin(), s.names.end(), [&](const std::string& n) {
    return s.exact ? name == n : absl::StartsWith(name, n);
  });
  return listed != s.exclude;
}

absl::StatusOr<std::string> PickSocketIface(absl::string_view spec,
                                            const std::vector<std::string>& interfaces) {
  for (const std::string& name : interfaces) {
    if (SocketIfnameMatches(spec, name)) return name;
  }
  return absl::NotFoundError(absl::StrCat(
      "--socket_ifname=", spec, " selects none of this host's interfaces with an address (",
      interfaces.empty() ? "none" : absl::StrJoin(interfaces, ", "), ")"));
}

std::vector<std::string> HostInterfaces() {
  std::vector<std::string> out;
  struct ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (struct ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_name == nullptr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (std::find(out.begin(), out.end(), i->ifa_name) == out.end()) out.emplace_back(i->ifa_name);
  }
  freeifaddrs(list);
  return out;
}

absl::StatusOr<std::string> UseSocketIfname(const std::string& spec) {
  if (absl::Status valid = CheckSocketIfname(spec); !valid.ok()) return valid;
  const char* set = std::getenv("NCCL_SOCKET_IFNAME");
  if (set != nullptr && spec != set) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--socket_ifname=", spec, " but the environment sets NCCL_SOCKET_IFNAME=", set,
        ": give the interface once (the flag sets NCCL_SOCKET_IFNAME)"));
  }
  absl::StatusOr<std::string> iface = PickSocketIface(spec, HostInterfaces());
  if (!iface.ok()) return iface.status();
  // NCCL reads it at its first communicator (engine/comm/nccl_communicator.cc), long after.
  setenv("NCCL_SOCKET_IFNAME", spec.c_str(), /*overwrite=*/1);
  return iface;
}

}  // namespace moe
