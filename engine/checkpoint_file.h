// The on-disk tensor file of a layer checkpoint (engine/checkpoint.h) and the atomic file
// writes it relies on.
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
#include "engine/tensor.h"

namespace moe {

inline constexpr uint32_t kTensorFileVersion = 1;

struct NamedTensor {
  std::string name;
  Tensor tensor;
};

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as in iSCSI/ext4/LevelDB;
// Crc32c("123456789") == 0xE3069283. Extend a running value by passing it as `crc`.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);
inline uint32_t Crc32c(absl::string_view data, uint32_t crc = 0) {
  return Crc32c(data.data(), data.size(), crc);
}
// The table-driven software path Crc32c takes on CPUs without SSE4.2 (public for tests).
uint32_t Crc32cPortable(const void* data, size_t size, uint32_t crc = 0);

// Writes `pieces` (concatenated) to `path` atomically: a temporary file in the same
// directory, fsync, rename over `path`, fsync of the directory. On failure `path` is untouched
// and the temporary file is removed.
absl::Status WriteFileAtomically(const std::string& path,
                                 const std::vector<absl::string_view>& pieces);

// Reads a whole file. NOT_FOUND when it does not exist.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

// Writes the tensors in order (names must be unique) with WriteFileAtomically.
absl::Status WriteTensorFile(const std::string& path, const std::vector<NamedTensor>& tensors);

// Reads and fully verifies a tensor file (see the layout above).
absl::StatusOr<std::vector<NamedTensor>> ReadTensorFile(const std::string& path);

// Creates `dir` (and missing parents); fine when it exists.
absl::Status MakeDirectories(const std::string& dir);

// The Status for a failed system call: NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED
// (ENOSPC) or INTERNAL, with `what` and strerror(err).
absl::Status ErrnoStatus(int err, absl::string_view what);

}  // namespace moe

#endif  // MOED_ENGINE_CHECKPOINT_FILE_H_
