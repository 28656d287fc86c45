// A floor under the thread stack sizes that libraries in moed ask for.
//
// Debian's civetweb (under prometheus-cpp's exposer, server/metrics.h) is built with a fixed
// 100 KiB stack for its threads (USE_STACK_SIZE). glibc carves a thread's static TLS out of its
// stack, and moed's process holds more than that: cuBLASLt (~94 KiB) and OpenBLAS (~61 KiB)
// come with the engine libraries moed links on a CUDA build. pthread_create then fails with
// EINVAL and the metrics server cannot start ("Cannot create threads"). This definition is
// found before libc's (the executable comes first in symbol lookup), raises any requested size
// to kMinStackBytes, and forwards to libc's. Larger requests are passed through unchanged.
#include <dlfcn.h>
#include <pthread.h>

#include <cstddef>

namespace {

constexpr size_t kMinStackBytes = size_t{1} << 20;

using SetStackSize = int (*)(pthread_attr_t*, size_t);

SetStackSize LibcSetStackSize() {
  static const SetStackSize libc =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  return libc;
}

}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t stack_size) {
  const SetStackSize libc = LibcSetStackSize();
  if (libc == nullptr) return 22;  // EINVAL: cannot happen with a dynamic libc
  return libc(attr, stack_size < kMinStackBytes ? kMinStackBytes : stack_size);
}
