// moe-worker --socket_ifname: NCCL_SOCKET_IFNAME's conventions (prefixes, '^' exclusion, '='
// exact names) as NCCL applies them, and the interface Gloo gets (server/socket_ifname.h).
#include "server/socket_ifname.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

namespace moe {
namespace {

using ::testing::HasSubstr;

TEST(SocketIfnameTest, PrefixesExclusionAndExactNames) {
  EXPECT_TRUE(SocketIfnameMatches("eth", "eth0"));
  EXPECT_TRUE(SocketIfnameMatches("eth0", "eth0"));
  EXPECT_TRUE(SocketIfnameMatches("eth0", "eth01"));   // a prefix, as NCCL
  EXPECT_FALSE(SocketIfnameMatches("=eth0", "eth01"));  // exact
  EXPECT_TRUE(SocketIfnameMatches("=eth0", "eth0"));
  EXPECT_TRUE(SocketIfnameMatches("ib,eth", "ib0"));
  EXPECT_TRUE(SocketIfnameMatches("ib,eth", "eth1"));
  EXPECT_FALSE(SocketIfnameMatches("ib,eth", "bond0"));
  EXPECT_FALSE(SocketIfnameMatches("^docker,lo", "docker0"));
  EXPECT_FALSE(SocketIfnameMatches("^docker,lo", "lo"));
  EXPECT_TRUE(SocketIfnameMatches("^docker,lo", "eth0"));
  EXPECT_TRUE(SocketIfnameMatches("^=docker", "docker0"));  // only "docker" itself excluded
  EXPECT_FALSE(SocketIfnameMatches("^=docker", "docker"));
  EXPECT_TRUE(SocketIfnameMatches("eth0:5000", "eth0"));  // a port is ignored
}

TEST(SocketIfnameTest, PicksTheFirstMatchInHostOrder) {
  const std::vector<std::string> host = {"lo", "docker0", "eth0", "eth1", "ib0"};
  EXPECT_EQ(*PickSocketIface("eth", host), "eth0");
  EXPECT_EQ(*PickSocketIface("ib,eth", host), "eth0");  // host order, not the list's
  EXPECT_EQ(*PickSocketIface("^docker,lo", host), "eth0");
  EXPECT_EQ(*PickSocketIface("=eth1", host), "eth1");
  absl::StatusOr<std::string> none = PickSocketIface("bond", host);
  ASSERT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("lo, docker0, eth0, eth1, ib0"));
}

TEST(SocketIfnameTest, RefusesASpecNamingNothing) {
  for (const char* bad : {"", "^", "=", "^=", ",", "eth0 ", " eth0", ":1234"}) {
    EXPECT_EQ(CheckSocketIfname(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(CheckSocketIfname("^docker,lo").ok());
}

// The real host: loopback always has an address, so "lo" is one of them.
TEST(SocketIfnameTest, HostInterfacesIncludeLoopback) {
  EXPECT_THAT(HostInterfaces(), ::testing::Contains("lo"));
}

TEST(SocketIfnameTest, SetsNcclSocketIfnameAndReturnsGloosInterface) {
  unsetenv("NCCL_SOCKET_IFNAME");
  absl::StatusOr<std::string> iface = UseSocketIfname("=lo");
  ASSERT_TRUE(iface.ok()) << iface.status();
  EXPECT_EQ(*iface, "lo");
  ASSERT_NE(std::getenv("NCCL_SOCKET_IFNAME"), nullptr);
  EXPECT_STREQ(std::getenv("NCCL_SOCKET_IFNAME"), "=lo");
  EXPECT_TRUE(UseSocketIfname("=lo").ok());  // the same value already set: fine
  unsetenv("NCCL_SOCKET_IFNAME");
}

TEST(SocketIfnameTest, RefusesAConflictingEnvironmentAndAMissingInterface) {
  setenv("NCCL_SOCKET_IFNAME", "ib0", 1);
  absl::StatusOr<std::string> conflict = UseSocketIfname("=lo");
  EXPECT_EQ(conflict.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(conflict.status().message(), HasSubstr("NCCL_SOCKET_IFNAME=ib0"));
  EXPECT_STREQ(std::getenv("NCCL_SOCKET_IFNAME"), "ib0");  // left as it was
  unsetenv("NCCL_SOCKET_IFNAME");
  absl::StatusOr<std::string> missing = UseSocketIfname("=nosuchif9");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::getenv("NCCL_SOCKET_IFNAME"), nullptr);
}

}  // namespace
}  // namespace moe
