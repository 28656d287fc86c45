#include "server/pid_namespace.h"

#include <unistd.h>

namespace moe {

std::string PidNamespace() {
  char link[128];
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  return n > 0 ? std::string(link, static_cast<size_t>(n)) : std::string();
}

}  // namespace moe
