// libFuzzer target: engine/checkpoint_file.cc's ReadTensorFile on arbitrary file contents (a
// checkpoint moed or a worker loads). It must refuse, never crash or over-allocate.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "engine/checkpoint_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    return std::string(tmp != nullptr ? tmp : "/tmp") + "/checkpoint_fuzz_" +
           std::to_string(getpid());
  }();
  FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return 0;
  if (size > 0) std::fwrite(data, 1, size, file);
  std::fclose(file);
  (void)moe::ReadTensorFile(path);
  return 0;
}
