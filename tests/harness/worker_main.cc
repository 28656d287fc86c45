// main() for test binaries that use the multi-process harness: a worker process (started by
// RunWorkers) runs its registered function; otherwise the binary runs its gtest tests.
#include <cstdio>

#include "gtest/gtest.h"
#include "tests/harness/multiprocess.h"

int main(int argc, char** argv) {
  const int worker_exit = moe::harness::MaybeRunAsWorker();
  if (worker_exit >= 0) {
    std::fflush(stdout);
    std::fflush(stderr);
    return worker_exit;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
