// PidNamespace: which pid namespace this process is in. The two ends of a step ring
// (server/worker_rings.h) compare theirs: the pids in a channel's header only mean the same
// processes to both when it is the same.
#ifndef MOED_SERVER_PID_NAMESPACE_H_
#define MOED_SERVER_PID_NAMESPACE_H_

#include <string>

namespace moe {

// "pid:[4026531836]" (readlink /proc/self/ns/pid); empty when unknown.
std::string PidNamespace();

}  // namespace moe

#endif  // MOED_SERVER_PID_NAMESPACE_H_
