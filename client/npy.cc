#include "client/npy.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace moe {
namespace client {
namespace {

// .npy layout: "\x93NUMPY", major, minor, header length (uint16 LE for 1.x, uint32 LE for 2.x
// and 3.x), the header (a Python dict literal, padded with spaces and ending in '\n' so that
// the data starts at a multiple of 64 bytes), then the raw C-order data.
constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("npy: ", what));
}

// The value that follows 'key': in the header dict, up to the next top-level ',' or '}' (a
// tuple's commas are inside parentheses).
absl::StatusOr<std::string> DictValue(absl::string_view header, absl::string_view key) {
  for (const char quote : {'\'', '"'}) {
    const std::string quoted = absl::StrCat(std::string(1, quote), key, std::string(1, quote));
    const size_t at = header.find(quoted);
    if (at == absl::string_view::npos) continue;
    size_t pos = header.find(':', at + quoted.size());
    if (pos == absl::string_view::npos) break;
    ++pos;
    int depth = 0;
    size_t end = pos;
    for (; end < header.size(); ++end) {
      const char c = header[end];
      if (c == '(') ++depth;
      if (c == ')') --depth;
      if (depth == 0 && (c == ',' || c == '}')) break;
    }
    return std::string(absl::StripAsciiWhitespace(header.substr(pos, end - pos)));
  }
  return Invalid(absl::StrCat("header has no '", key, "'"));
}

absl::StatusOr<DType> DTypeFromDescr(std::string descr) {
  if (descr.size() >= 2 && (descr.front() == '\'' || descr.front() == '"')) {
    descr = descr.substr(1, descr.size() - 2);
  }
  // '=' is native order; every platform this builds on is little-endian. '|' is used for
  // one-byte types only, none of which are supported.
  if (!descr.empty() && descr[0] == '=') descr[0] = '<';
  if (descr == "<f4") return DType::kFloat32;
  if (descr == "<f8") return DType::kFloat64;
  if (descr == "<i4") return DType::kInt32;
  if (descr == "<i8") return DType::kInt64;
  return Invalid(absl::StrCat("unsupported dtype ", descr,
                              " (supported: <f4, <f8, <i4, <i8; store bf16 as <f4)"));
}

const char* DescrOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return "<f8";
    case DType::kInt32:
      return "<i4";
    case DType::kInt64:
      return "<i8";
    default:
      return "<f4";
  }
}

absl::StatusOr<std::vector<int64_t>> ParseShape(const std::string& text) {
  if (text.size() < 2 || text.front() != '(' || text.back() != ')') {
    return Invalid(absl::StrCat("bad shape ", text));
  }
  std::vector<int64_t> shape;
  for (absl::string_view part : absl::StrSplit(text.substr(1, text.size() - 2), ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) continue;  // "(3,)" and "()"
    int64_t dim = 0;
    if (!absl::SimpleAtoi(part, &dim) || dim < 0) {
      return Invalid(absl::StrCat("bad shape ", text));
    }
    shape.push_back(dim);
  }
  return shape;
}

}  // namespace

absl::StatusOr<Tensor> ParseNpy(absl::string_view contents) {
  if (contents.size() < kMagicSize + 4 || std::memcmp(contents.data(), kMagic, kMagicSize) != 0) {
    return Invalid("not a .npy file (bad magic)");
  }
  const uint8_t major = static_cast<uint8_t>(contents[kMagicSize]);
  size_t header_len = 0;
  size_t header_start = 0;
  const auto byte = [&](size_t i) {
    return static_cast<size_t>(static_cast<uint8_t>(contents[i]));
  };
  if (major == 1) {
    header_len = byte(8) | byte(9) << 8;
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (contents.size() < 12) return Invalid("truncated header");
    header_len = byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24;
    header_start = 12;
  } else {
    return Invalid(absl::StrCat("unsupported format version ", major));
  }
  if (contents.size() < header_start + header_len) return Invalid("truncated header");
  const absl::string_view header = contents.substr(header_start, header_len);

  std::string descr, fortran, shape_text;
  {
    auto v = DictValue(header, "descr");
    if (!v.ok()) return v.status();
    descr = *v;
    v = DictValue(header, "fortran_order");
    if (!v.ok()) return v.status();
    fortran = *v;
    v = DictValue(header, "shape");
    if (!v.ok()) return v.status();
    shape_text = *v;
  }
  absl::StatusOr<DType> dtype = DTypeFromDescr(descr);
  if (!dtype.ok()) return dtype.status();
  if (fortran != "False") return Invalid("fortran_order arrays are not supported");
  absl::StatusOr<std::vector<int64_t>> shape = ParseShape(shape_text);
  if (!shape.ok()) return shape.status();

  const absl::string_view data = contents.substr(header_start + header_len);
  const size_t expected = static_cast<size_t>(NumElements(*shape)) * DTypeSize(*dtype);
  if (data.size() != expected) {
    return Invalid(absl::StrCat("data is ", data.size(), " bytes, shape ", shape_text, " of ",
                                descr, " needs ", expected));
  }
  return Tensor::FromBytes(*dtype, *shape, data);
}

std::string SerializeNpy(const Tensor& tensor) {
  const Tensor stored =
      tensor.dtype() == DType::kBFloat16 ? tensor.ConvertTo(DType::kFloat32) : tensor;
  std::string shape = "(";
  for (int64_t d : stored.shape()) absl::StrAppend(&shape, d, ", ");
  if (stored.rank() > 1) shape.resize(shape.size() - 2);   // "(3, 4)"
  if (stored.rank() == 1) shape.resize(shape.size() - 1);  // "(3,)"
  shape += ")";
  std::string header = absl::StrCat("{'descr': '", DescrOf(stored.dtype()),
                                    "', 'fortran_order': False, 'shape': ", shape, ", }");
  // Pad so that magic + version + length + header is a multiple of 64, ending with '\n'.
  const size_t unpadded = kMagicSize + 2 + 2 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string out(kMagic, kMagicSize);
  out.push_back(1);
  out.push_back(0);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  out.append(stored.bytes().data(), stored.bytes().size());
  return out;
}

absl::StatusOr<Tensor> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  absl::StatusOr<Tensor> t = ParseNpy(buffer.str());
  if (!t.ok()) {
    return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  }
  return t;
}

absl::Status WriteNpy(const std::string& path, const Tensor& tensor) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("cannot open ", path, " for writing"));
  const std::string bytes = SerializeNpy(tensor);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("write to ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace client
}  // namespace moe
