#include "server/heap_trim.h"

#include <malloc.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int64_t, heap_retain_bytes, 0,
          "free heap memory this process keeps for reuse; above it, returned to the system "
          "within half a second (malloc_trim). 0: 256 MiB (4 GiB on a CUDA worker); -1: never "
          "(server/heap_trim.h)");

namespace moe {

int64_t HeapRetainBytes(bool cuda_worker) {
  const int64_t flag = absl::GetFlag(FLAGS_heap_retain_bytes);
  if (flag != 0) return flag;
  return cuda_worker ? kHeapRetainBytesCudaDefault : kHeapRetainBytesDefault;
}

std::vector<std::string> HeapRetainFlagsForChild() {
  const int64_t flag = absl::GetFlag(FLAGS_heap_retain_bytes);
  if (flag == 0) return {};
  return {absl::StrCat("--heap_retain_bytes=", flag)};
}

bool BoundArenaTops() {
  const bool mmap_set = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kHeapMmapThresholdBytes)) == 1;
  const bool trim_set = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kArenaTopRetainBytes)) == 1;
  return mmap_set && trim_set;
}

int64_t FreeHeapBytes() { return static_cast<int64_t>(mallinfo2().fordblks); }

bool HeapTrimmer::TrimIfOver(int64_t retain_bytes) {
  if (retain_bytes < 0 || FreeHeapBytes() <= retain_bytes) return false;
  malloc_trim(0);
  return true;
}

HeapTrimmer::HeapTrimmer(int64_t retain_bytes, absl::Duration period)
    : retain_bytes_(retain_bytes), period_(period) {
  if (retain_bytes_ < 0) return;
  thread_ = std::thread([this] {
    // A trim leaves the chunks free (only their pages go), so the free bytes stay over the
    // bound: trim again only once they changed, not every period of an idle process.
    int64_t free_at_last_trim = -1;
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), period_)) {
      mu_.Unlock();
      const int64_t free = FreeHeapBytes();
      if (free > retain_bytes_ && free != free_at_last_trim) {
        malloc_trim(0);
        free_at_last_trim = free;
        trims_.fetch_add(1);
      }
      mu_.Lock();
    }
  });
}

HeapTrimmer::~HeapTrimmer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace moe
