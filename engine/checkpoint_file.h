// The on-disk tensor file of a layer checkpoint (engine/checkpoint.h); the atomic file writes
// it relies on are in engine/file_util.h.
//
//   RETURN_IF_ERROR(WriteTensorFile(dir + "/router.bin", {{"gate", gate}}));
//   ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, ReadTensorFile(dir + "/router.bin"));
//
// Layout (all integers little-endian):
//   header   "MOEDTNSR" (8 bytes) | u32 version (1) | u32 tensor_count | u32 crc32c(previous 16)
//   tensor   u32 name_len | name | u32 dtype code | u32 rank | i64 dims[rank] |
//            u64 byte_length | u32 crc32c(data) | u32 crc32c(this record up to here) | data
//   trailer  "MOEDEND!" (8 bytes), then end of file
// dtype codes: 1 FP32, 2 BF16, 3 FP64, 4 INT32, 5 INT64 (fixed here, independent of the enum).
// A reader rejects any defect (wrong magic, unknown version, bad checksum, byte length that
// disagrees with dtype and shape, truncation, trailing bytes) with DATA_LOSS naming the file;
// so every byte of the file is covered by a checksum or a check.
#ifndef MOED_ENGINE_CHECKPOINT_FILE_H_
#define MOED_ENGINE_CHECKPOINT_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/file_util.h"  // WriteFileAtomically, ReadWholeFile, MakeDirectories
#include "engine/tensor.h"

namespace moe {

inline constexpr uint32_t kTensorFileVersion = 1;

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as in iSCSI/ext4/LevelDB;
// Crc32c("123456789") == 0xE3069283. Extend a running value by passing it as `crc`.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);
inline uint32_t Crc32c(absl::string_view data, uint32_t crc = 0) {
  return Crc32c(data.data(), data.size(), crc);
}
// The table-driven software path Crc32c takes on CPUs without SSE4.2 (public for tests).
uint32_t Crc32cPortable(const void* data, size_t size, uint32_t crc = 0);

// Writes the tensors in order (names must be unique) with WriteFileAtomically.
absl::Status WriteTensorFile(const std::string& path, const std::vector<NamedTensor>& tensors);

// Reads and fully verifies a tensor file (see the layout above).
absl::StatusOr<std::vector<NamedTensor>> ReadTensorFile(const std::string& path);

}  // namespace moe

#endif  // MOED_ENGINE_CHECKPOINT_FILE_H_
