// The network interface a worker's peer traffic uses, named once for Gloo and NCCL
// (moe-worker --socket_ifname), with NCCL_SOCKET_IFNAME's conventions (NCCL's documentation,
// "NCCL_SOCKET_IFNAME"; parsed as NCCL's findInterfaces does): a comma-separated list of
// interface-name prefixes ("eth", "ib0,eth1"); a leading '^' uses the interfaces that match
// none of them instead ("^docker,lo"); a '=' after it (or at the start) matches whole names
// ("=eth0", "^=docker0"); a ":port" after a name is ignored, as NCCL ignores it here.
//
//   absl::StatusOr<std::string> iface = UseSocketIfname("eth0");  // NCCL_SOCKET_IFNAME=eth0
//   if (iface.ok()) gloo.iface = *iface;                         // "eth0"
#ifndef MOED_SERVER_SOCKET_IFNAME_H_
#define MOED_SERVER_SOCKET_IFNAME_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

// INVALID_ARGUMENT when `spec` names no interface ("", "^", "=", ",", whitespace).
absl::Status CheckSocketIfname(absl::string_view spec);

// Whether interface `name` is one `spec` selects.
bool SocketIfnameMatches(absl::string_view spec, absl::string_view name);

// The first of `interfaces` (in their order) that `spec` selects; NOT_FOUND naming the spec and
// the interfaces otherwise.
absl::StatusOr<std::string> PickSocketIface(absl::string_view spec,
                                            const std::vector<std::string>& interfaces);

// This host's interfaces that have an IPv4 or IPv6 address, in getifaddrs order, each once
// (the candidates NCCL's socket bootstrap and transport choose among).
std::vector<std::string> HostInterfaces();

// Makes `spec` NCCL's interface in this process (sets NCCL_SOCKET_IFNAME=spec; call it before
// any other thread runs) and returns the interface for Gloo, which takes one name: the first
// of HostInterfaces() that spec selects. INVALID_ARGUMENT for a bad spec, FAILED_PRECONDITION
// when the environment already sets NCCL_SOCKET_IFNAME to something else, NOT_FOUND when no
// interface matches (NCCL would find none either); the environment is unchanged then.
absl::StatusOr<std::string> UseSocketIfname(const std::string& spec);

}  // namespace moe

#endif  // MOED_SERVER_SOCKET_IFNAME_H_
