// The byte layout of a RingChannel's shared region (transport/README.md draws it). Both
// processes map the same bytes; nothing here is trusted by the side that reads it
// (step_ring.cc and ring_channel.cc validate every value before use). Little-endian; the
// Python twin (client/python/moe_client/ring.py) spells the same offsets with struct.
//
//   [0, 64)        RegionHeader
//   [64, 192)      RingControl of the request ring  (caller -> server)
//   [192, 320)     RingControl of the response ring (server -> caller)
//   [320, 4096)    zero
//   [4096, 4096 + R)        request ring's data, R = ring_bytes (a power of two)
//   [4096 + R, 4096 + 2R)   response ring's data
#ifndef MOED_TRANSPORT_RING_LAYOUT_H_
#define MOED_TRANSPORT_RING_LAYOUT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace moe {
namespace ring_layout {

inline constexpr uint32_t kMagic = 0x474E4952;  // "RING" little-endian
inline constexpr uint32_t kVersion = 1;
inline constexpr uint64_t kDataOffset = 4096;
inline constexpr uint64_t kMinRingBytes = 4096;
inline constexpr uint64_t kMaxRingBytes = uint64_t{1} << 30;
inline constexpr uint64_t kRecordAlign = 16;

struct RegionHeader {
  uint32_t magic;                       // kMagic, written last by the creator
  uint32_t version;                     // kVersion
  uint64_t region_bytes;                // kDataOffset + 2 * ring_bytes
  uint64_t ring_bytes;                  // data bytes of each ring, a power of two in [4 KiB, 1 GiB]
  std::atomic<uint32_t> caller_pid;     // 0 until a caller attaches
  std::atomic<uint32_t> server_pid;     // 0 until a server attaches
  std::atomic<uint32_t> caller_closed;  // 1: the caller left (rings the request data bell)
  std::atomic<uint32_t> server_closed;  // 1: the server left (rings the response data bell)
  uint8_t reserved[24];
};

// One direction. head and tail count bytes ever published/consumed (never wrap in practice:
// 2^64 bytes); a record starts at offset (tail % ring_bytes) of the data area. The producer
// alone writes head and data_bell, the consumer alone tail and space_bell, so every word has
// one writer (the Python twin needs no atomic read-modify-write).
struct RingControl {
  std::atomic<uint64_t> head;       // release-stored after the record's bytes are written
  std::atomic<uint32_t> data_bell;  // rung by the producer after each publish
  uint8_t pad0[52];
  std::atomic<uint64_t> tail;        // release-stored after the record's bytes are copied out
  std::atomic<uint32_t> space_bell;  // rung by the consumer after each consume
  uint8_t pad1[52];
};

// Precedes every record's payload, at a kRecordAlign-aligned position (so it never wraps);
// the payload follows and may wrap to the data area's start. A record takes
// RecordBytes(payload_bytes) of the ring.
struct RecordHeader {
  uint32_t payload_bytes;
  uint32_t status_code;  // responses: an absl::StatusCode (0 OK; else payload = message)
  uint64_t sequence;     // the call's number; a response repeats its request's
};

inline constexpr uint64_t RecordBytes(uint64_t payload_bytes) {
  return (sizeof(RecordHeader) + payload_bytes + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
}

static_assert(sizeof(RegionHeader) == 64, "layout");
static_assert(offsetof(RegionHeader, caller_pid) == 24, "layout");
static_assert(sizeof(RingControl) == 128, "layout");
static_assert(offsetof(RingControl, data_bell) == 8, "layout");
static_assert(offsetof(RingControl, tail) == 64, "layout");
static_assert(offsetof(RingControl, space_bell) == 72, "layout");
static_assert(sizeof(RecordHeader) == 16, "layout");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");

inline constexpr uint64_t kRequestControlOffset = 64;
inline constexpr uint64_t kResponseControlOffset = 192;

}  // namespace ring_layout
}  // namespace moe

#endif  // MOED_TRANSPORT_RING_LAYOUT_H_
