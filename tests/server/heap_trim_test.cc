// HeapTrimmer (server/heap_trim.h): free heap above the bound goes back to the system, memory
// in use stays, nothing happens below the bound or with a negative one; BoundArenaTops returns
// the top of a thread's arena, which malloc_trim leaves.
#include "server/heap_trim.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Resident bytes of this process (/proc/self/statm).
int64_t ResidentBytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  const int read = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return read == 2 ? resident * sysconf(_SC_PAGESIZE) : -1;
}

// 64 MiB freed inside the heap: blocks below the mmap threshold, touched, then all freed but
// the last (which keeps glibc from trimming the heap's top by itself). Returns the last.
char* FreeSixtyFourMiB() {
  mallopt(M_MMAP_THRESHOLD, 4 << 20);  // fixed: 1 MiB blocks come from the heap
  std::vector<char*> blocks;
  for (int i = 0; i < 65; ++i) {
    blocks.push_back(static_cast<char*>(malloc(kMiB)));
    std::memset(blocks.back(), 1, kMiB);
  }
  for (int i = 0; i < 64; ++i) free(blocks[i]);
  return blocks.back();
}

TEST(HeapTrimTest, ReturnsFreeHeapAboveTheBoundOnly) {
  char* kept = FreeSixtyFourMiB();
  ASSERT_GE(FreeHeapBytes(), 60 * kMiB);
  EXPECT_FALSE(HeapTrimmer::TrimIfOver(1024 * kMiB));  // below the bound: nothing
  EXPECT_FALSE(HeapTrimmer::TrimIfOver(-1));           // never
  const int64_t before = ResidentBytes();
  EXPECT_TRUE(HeapTrimmer::TrimIfOver(16 * kMiB));
  EXPECT_LE(ResidentBytes(), before - 48 * kMiB) << "the free 64 MiB stayed resident";
  EXPECT_EQ(kept[kMiB - 1], 1);  // memory in use is untouched
  free(kept);
}

TEST(HeapTrimTest, TheThreadTrimsWithinItsPeriod) {
  HeapTrimmer idle(-1);
  EXPECT_EQ(idle.trims(), 0);
  char* kept = FreeSixtyFourMiB();
  HeapTrimmer trimmer(16 * kMiB, absl::Milliseconds(20));
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (trimmer.trims() == 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_GE(trimmer.trims(), 1);
  // Nothing freed since: the free bytes stay over the bound (a trim only drops their pages),
  // yet no trim every period follows (15 periods here).
  const int64_t trimmed = trimmer.trims();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_LT(trimmer.trims() - trimmed, 5);
  free(kept);
}

// On a thread of its own (so in a non-main arena, as moed's and the workers' call threads):
// 48 MiB touched in 1 MiB blocks, all freed, then what the trimmer does (malloc_trim).
// Returns how much of it stayed resident: with glibc's thresholds after large frees, the
// arena's top (about a third of the peak, measured with glibc 2.36).
int64_t KeptAtTheTopOfAThreadsArena() {
  int64_t kept = 0;
  std::thread([&kept] {
    const int64_t before = ResidentBytes();
    std::vector<char*> blocks;
    for (int i = 0; i < 48; ++i) {
      blocks.push_back(static_cast<char*>(malloc(kMiB)));
      std::memset(blocks.back(), 1, kMiB);
    }
    for (char* block : blocks) free(block);
    malloc_trim(0);
    kept = ResidentBytes() - before;
  }).join();
  return kept;
}

// glibc's dynamic thresholds once a process freed a 32 MiB mapped block (as a loaded worker
// does): 1 MiB blocks come from the heap, and a free trims its arena's top past 64 MiB only.
void SetGlibcsThresholdsAfterLargeFrees() {
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 32 << 20), 1);
  ASSERT_EQ(mallopt(M_TRIM_THRESHOLD, 64 << 20), 1);
}

TEST(HeapTrimTest, ArenaTopsAreBounded) {
  SetGlibcsThresholdsAfterLargeFrees();
  ASSERT_TRUE(BoundArenaTops());
  EXPECT_LE(KeptAtTheTopOfAThreadsArena(), kArenaTopRetainBytes + 2 * kMiB)
      << "the free top of a thread's arena stayed resident";
  // Without the bound (the cause of the workers' creep): malloc_trim leaves that top.
  SetGlibcsThresholdsAfterLargeFrees();
  EXPECT_GE(KeptAtTheTopOfAThreadsArena(), 8 * kMiB)
      << "glibc returned a non-main arena's top by itself: the bound above proves nothing";
}

}  // namespace
}  // namespace moe
