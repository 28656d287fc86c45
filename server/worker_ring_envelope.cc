#include "server/worker_ring_envelope.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {

std::string WrapEnvelope(uint8_t kind, absl::Time deadline, absl::string_view body) {
  const int64_t remaining_ms = std::clamp<int64_t>(
      absl::ToInt64Milliseconds(deadline - absl::Now()), 1, int64_t{0xFFFFFFFF});
  std::string record(kEnvelopeBytes, '\0');
  record[0] = static_cast<char>(kind);
  for (int i = 0; i < 4; ++i) record[4 + i] = static_cast<char>((remaining_ms >> (8 * i)) & 0xFF);
  record.append(body.data(), body.size());
  return record;
}

absl::StatusOr<Envelope> UnwrapEnvelope(absl::string_view record) {
  if (record.size() < kEnvelopeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring record of ", record.size(), " bytes is shorter than its envelope"));
  }
  const auto byte = [&](int i) { return static_cast<uint8_t>(record[i]); };
  if (byte(0) == 0 || byte(1) != 0 || byte(2) != 0 || byte(3) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ring record envelope malformed: kind ",
                                                   byte(0), ", reserved bytes ", byte(1), " ",
                                                   byte(2), " ", byte(3)));
  }
  uint32_t remaining_ms = 0;
  for (int i = 0; i < 4; ++i) remaining_ms |= static_cast<uint32_t>(byte(4 + i)) << (8 * i);
  Envelope envelope;
  envelope.kind = byte(0);
  envelope.deadline = absl::Now() + absl::Milliseconds(remaining_ms);
  envelope.body = record.substr(kEnvelopeBytes);
  return envelope;
}

std::string PidNamespace() {
  char link[128];
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  return n > 0 ? std::string(link, static_cast<size_t>(n)) : std::string();
}

}  // namespace moe
