// Bounds the freed heap memory moed and moe-worker keep (issue 41 item 7).
//
// glibc's malloc keeps memory a thread frees in that thread's arena (up to 8 arenas per core)
// for reuse, and gives it back to the system only from the top of the main heap. moed runs
// each call body on its own handler thread, so under many callers each arena in turn holds
// the buffers of a large call it once served: after 20 s of 16 callers with some 64 MiB
// forwards (tests/chaos/memory_soak_test, 2-core VM) moed's anonymous RSS stayed at 300-500 MB
// instead of its 100 MB, all of it free heap that malloc_trim(0) returned (to 102 MB). Nothing
// leaked; the cache had no bound, and on a host with more cores it has more arenas. A
// HeapTrimmer gives that bound: every `period` it reads how much free memory the arenas hold
// (mallinfo2) and, above `retain_bytes` and changed since its last trim, returns it with
// malloc_trim(0) (whole free pages of every arena). Memory in use is never touched; a call after a trim faults its pages in
// again, which is the price of the bound. moe-worker runs one too (its gRPC threads serve
// steps the same way). malloc_trim does not cover the free memory at the top of a non-main
// arena's heap: glibc returns that only on a free that leaves it over M_TRIM_THRESHOLD, which
// its dynamic threshold raises to 64 MiB once a large mapped block was freed, so each of up to
// 8 arenas per core kept up to 64 MiB (the workers' RSS crept up round after round of load
// while malloc's in-use bytes stayed flat). BoundArenaTops fixes that threshold instead.
//
//   BoundArenaTops();                                                // once, at start
//   HeapTrimmer trimmer(HeapRetainBytes(/*cuda_worker=*/false));   // until destroyed
//   HeapTrimmer::TrimIfOver(64 << 20);                               // or one check now
#ifndef MOED_SERVER_HEAP_TRIM_H_
#define MOED_SERVER_HEAP_TRIM_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moe {

// Defaults of --heap_retain_bytes = 0 (derived). A CUDA worker keeps more: its host buffers
// are reused by every step on purpose (server/worker_main.cc, M_MMAP_MAX = 0).
inline constexpr int64_t kHeapRetainBytesDefault = int64_t{256} << 20;
inline constexpr int64_t kHeapRetainBytesCudaDefault = int64_t{4} << 30;

// Free memory a free leaves at the top of one arena's heap (M_TRIM_THRESHOLD; more goes back
// at once). With up to 8 arenas per core, each keeps at most this much between calls.
inline constexpr int64_t kArenaTopRetainBytes = int64_t{4} << 20;
// Blocks of this size and more are mapped alone and unmapped on free (M_MMAP_THRESHOLD): the
// ceiling of glibc's dynamic threshold on 64-bit, where a loaded process's threshold goes
// anyway once it freed a block that large, so smaller step buffers stay on the heap for reuse.
inline constexpr int64_t kHeapMmapThresholdBytes = int64_t{32} << 20;

// Sets both (mallopt); glibc then stops moving them with the blocks a process frees. Call
// once, before the threads that serve calls start; false if glibc refused either. Not on a
// CUDA worker, which keeps its heap on purpose (server/worker_main.cc).
bool BoundArenaTops();

// --heap_retain_bytes (moed and moe-worker): > 0 the bound, 0 the default above for this
// process, < 0 never trim (glibc's own behaviour).
int64_t HeapRetainBytes(bool cuda_worker);
// The flag for an embedded moe-worker when moed was given one ("--heap_retain_bytes=N");
// empty when it was left at 0 (the worker derives its own).
std::vector<std::string> HeapRetainFlagsForChild();

// Free bytes the heap holds in its arenas (mallinfo2's fordblks).
int64_t FreeHeapBytes();

class HeapTrimmer {
 public:
  // retain_bytes < 0: starts nothing.
  explicit HeapTrimmer(int64_t retain_bytes, absl::Duration period = absl::Milliseconds(500));
  ~HeapTrimmer();  // stops and joins the thread
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

  // malloc_trim(0) when the free heap is over retain_bytes; returns whether it trimmed.
  static bool TrimIfOver(int64_t retain_bytes);
  int64_t trims() const { return trims_.load(); }

 private:
  const int64_t retain_bytes_;
  const absl::Duration period_;
  std::atomic<int64_t> trims_{0};
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace moe

#endif  // MOED_SERVER_HEAP_TRIM_H_
