// Tensor files of layer checkpoints: CRC-32C, strict reading (atomic writes: file_util.h).
#include "engine/checkpoint_file.h"

#include <array>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace moe {
namespace {

constexpr char kMagic[8] = {'M', 'O', 'E', 'D', 'T', 'N', 'S', 'R'};
constexpr char kTrailer[8] = {'M', 'O', 'E', 'D', 'E', 'N', 'D', '!'};
constexpr uint32_t kMaxNameLength = 4096;
constexpr uint32_t kMaxRank = 8;

// ---- CRC-32C: slicing-by-8 in software, SSE4.2 instructions where the CPU has them ----

using CrcTables = std::array<std::array<uint32_t, 256>, 8>;

const CrcTables& Tables() {
  static const CrcTables tables = [] {
    CrcTables t;
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int b = 0; b < 8; ++b) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
    }
    return t;
  }();
  return tables;
}

uint32_t Crc32cSoftware(const uint8_t* p, size_t n, uint32_t crc) {
  const CrcTables& t = Tables();
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;  // little-endian hosts (x86-64, arm64): bytes in memory order
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
          t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xffu];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const uint8_t* p, size_t n,
                                                          uint32_t crc) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
bool HaveHardwareCrc() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "checkpoint files are little-endian");

// ---- encoding ----

template <typename T>
void Put(std::string* out, T value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Reads fixed-size fields from a file's bytes, failing with DATA_LOSS on truncation.
class Reader {
 public:
  Reader(const std::string& path, absl::string_view data) : path_(path), data_(data) {}
  template <typename T>
  absl::Status Get(T* value, absl::string_view what) {
    if (data_.size() - pos_ < sizeof(T)) return Truncated(what);
    std::memcpy(value, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }
  absl::Status Bytes(size_t n, absl::string_view* out, absl::string_view what) {
    if (data_.size() - pos_ < n) return Truncated(what);
    *out = data_.substr(pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return data_.size() - pos_; }
  absl::string_view Since(size_t begin) const { return data_.substr(begin, pos_ - begin); }
  absl::Status Error(absl::string_view message) const {
    return absl::DataLossError(absl::StrCat("checkpoint file ", path_, ": ", message));
  }

 private:
  absl::Status Truncated(absl::string_view what) const {
    return Error(
        absl::StrCat("truncated (reading ", what, " at byte ", pos_, " of ", data_.size(), ")"));
  }
  const std::string& path_;
  absl::string_view data_;
  size_t pos_ = 0;
};

uint32_t DTypeCode(DType d) {
  switch (d) {
    case DType::kFloat32:
      return 1;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat64:
      return 3;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 5;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      break;  // never stored: FP8 copies are rebuilt from the fp32 masters
  }
  return 0;
}

bool DTypeFromCode(uint32_t code, DType* out) {
  static constexpr DType kTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat64,
                                     DType::kInt32, DType::kInt64};
  if (code < 1 || code > 5) return false;
  *out = kTypes[code - 1];
  return true;
}

}  // namespace

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (HaveHardwareCrc()) return ~Crc32cHardware(p, size, crc);
#endif
  return ~Crc32cSoftware(p, size, crc);
}

uint32_t Crc32cPortable(const void* data, size_t size, uint32_t crc) {
  return ~Crc32cSoftware(static_cast<const uint8_t*>(data), size, ~crc);
}

absl::Status WriteTensorFile(const std::string& path, const std::vector<NamedTensor>& tensors) {
  std::set<std::string> names;
  std::string header(kMagic, sizeof(kMagic));
  Put<uint32_t>(&header, kTensorFileVersion);
  Put<uint32_t>(&header, static_cast<uint32_t>(tensors.size()));
  Put<uint32_t>(&header, Crc32c(header));
  // One record header per tensor; the data pieces point into the tensors themselves.
  std::vector<std::string> records(tensors.size());
  std::vector<absl::string_view> pieces = {header};
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedTensor& nt = tensors[i];
    if (nt.name.empty() || nt.name.size() > kMaxNameLength || !names.insert(nt.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor name '", nt.name, "' is empty, too long or repeated"));
    }
    if (nt.tensor.rank() > static_cast<int>(kMaxRank)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", nt.name, " has rank > 8"));
    }
    std::string& r = records[i];
    Put<uint32_t>(&r, static_cast<uint32_t>(nt.name.size()));
    r += nt.name;
    Put<uint32_t>(&r, DTypeCode(nt.tensor.dtype()));
    Put<uint32_t>(&r, static_cast<uint32_t>(nt.tensor.rank()));
    for (int64_t d : nt.tensor.shape()) Put<int64_t>(&r, d);
    Put<uint64_t>(&r, nt.tensor.num_bytes());
    Put<uint32_t>(&r, Crc32c(nt.tensor.bytes()));
    Put<uint32_t>(&r, Crc32c(r));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    pieces.push_back(records[i]);
    pieces.push_back(tensors[i].tensor.bytes());
  }
  pieces.push_back(absl::string_view(kTrailer, sizeof(kTrailer)));
  return WriteFileAtomically(path, pieces);
}

absl::StatusOr<std::vector<NamedTensor>> ReadTensorFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string data, ReadWholeFile(path));
  Reader in(path, data);
  absl::string_view magic;
  RETURN_IF_ERROR(in.Bytes(sizeof(kMagic), &magic, "magic"));
  if (magic != absl::string_view(kMagic, sizeof(kMagic))) {
    return in.Error("bad magic (not a moed checkpoint tensor file)");
  }
  uint32_t version = 0, count = 0, header_crc = 0;
  RETURN_IF_ERROR(in.Get(&version, "version"));
  RETURN_IF_ERROR(in.Get(&count, "tensor count"));
  const uint32_t expected_header_crc = Crc32c(in.Since(0));
  RETURN_IF_ERROR(in.Get(&header_crc, "header checksum"));
  if (header_crc != expected_header_crc) return in.Error("header checksum mismatch");
  if (version != kTensorFileVersion) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint file ", path, ": version ",
                                                      version,
                                                      " is not supported (this build "
                                                      "reads version ",
                                                      kTensorFileVersion, ")"));
  }
  std::vector<NamedTensor> tensors;
  std::set<std::string> names;
  for (uint32_t i = 0; i < count; ++i) {
    const size_t record_begin = in.pos();
    uint32_t name_length = 0, dtype_code = 0, rank = 0, data_crc = 0, record_crc = 0;
    uint64_t byte_length = 0;
    absl::string_view name;
    RETURN_IF_ERROR(in.Get(&name_length, "name length"));
    if (name_length == 0 || name_length > kMaxNameLength) {
      return in.Error(absl::StrCat("tensor ", i, ": bad name length ", name_length));
    }
    RETURN_IF_ERROR(in.Bytes(name_length, &name, "name"));
    RETURN_IF_ERROR(in.Get(&dtype_code, "dtype"));
    RETURN_IF_ERROR(in.Get(&rank, "rank"));
    if (rank > kMaxRank) return in.Error(absl::StrCat("tensor ", i, ": bad rank ", rank));
    std::vector<int64_t> shape(rank);
    for (uint32_t d = 0; d < rank; ++d) RETURN_IF_ERROR(in.Get(&shape[d], "shape"));
    RETURN_IF_ERROR(in.Get(&byte_length, "byte length"));
    RETURN_IF_ERROR(in.Get(&data_crc, "data checksum"));
    const uint32_t expected_record_crc = Crc32c(in.Since(record_begin));
    RETURN_IF_ERROR(in.Get(&record_crc, "record checksum"));
    if (record_crc != expected_record_crc) {
      return in.Error(absl::StrCat("tensor ", i, ": record header checksum mismatch"));
    }
    const std::string tensor_name(name);
    DType dtype;
    if (!DTypeFromCode(dtype_code, &dtype)) {
      return in.Error(absl::StrCat("tensor ", tensor_name, ": unknown dtype code ", dtype_code));
    }
    absl::Status size_ok = CheckByteCount(tensor_name, dtype, shape, byte_length);
    if (!size_ok.ok()) return in.Error(size_ok.message());
    absl::string_view bytes;
    RETURN_IF_ERROR(in.Bytes(byte_length, &bytes, absl::StrCat("data of ", tensor_name)));
    if (Crc32c(bytes) != data_crc) {
      return in.Error(absl::StrCat("tensor ", tensor_name, ": data checksum mismatch"));
    }
    if (!names.insert(tensor_name).second) {
      return in.Error(absl::StrCat("tensor ", tensor_name, " appears twice"));
    }
    ASSIGN_OR_RETURN(Tensor tensor, Tensor::FromBytes(dtype, shape, bytes));
    tensors.push_back({tensor_name, std::move(tensor)});
  }
  absl::string_view trailer;
  RETURN_IF_ERROR(in.Bytes(sizeof(kTrailer), &trailer, "trailer"));
  if (trailer != absl::string_view(kTrailer, sizeof(kTrailer))) return in.Error("bad trailer");
  if (in.remaining() != 0) {
    return in.Error(absl::StrCat(in.remaining(), " unexpected bytes after the trailer"));
  }
  return tensors;
}

}  // namespace moe
