#include "transport/step_envelope.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe {

std::string EncodeStepEnvelope(uint8_t kind, absl::Duration deadline, absl::string_view body) {
  const int64_t ms = std::clamp<int64_t>(absl::ToInt64Milliseconds(deadline), 1,
                                         int64_t{kMaxStepDeadlineMs});
  std::string record(kStepEnvelopeBytes + body.size(), '\0');
  record[0] = static_cast<char>(kind);
  const uint32_t value = static_cast<uint32_t>(ms);
  for (int i = 0; i < 4; ++i) record[4 + i] = static_cast<char>((value >> (8 * i)) & 0xFF);
  if (!body.empty()) std::memcpy(&record[kStepEnvelopeBytes], body.data(), body.size());
  return record;
}

absl::StatusOr<StepEnvelope> DecodeStepEnvelope(absl::string_view record) {
  if (record.size() < kStepEnvelopeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("step record: ", record.size(), " bytes, shorter than its 8-byte envelope"));
  }
  StepEnvelope envelope;
  envelope.kind = static_cast<uint8_t>(record[0]);
  if (envelope.kind == 0) return absl::InvalidArgumentError("step record: kind 0");
  if (record[1] != 0 || record[2] != 0 || record[3] != 0) {
    return absl::InvalidArgumentError("step record: envelope bytes 1-3 are not zero");
  }
  uint32_t ms = 0;
  for (int i = 0; i < 4; ++i) ms |= uint32_t{static_cast<uint8_t>(record[4 + i])} << (8 * i);
  if (ms == 0 || ms > kMaxStepDeadlineMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("step record: deadline ", ms, " ms is not in [1, ", kMaxStepDeadlineMs, "]"));
  }
  envelope.deadline = absl::Milliseconds(ms);
  envelope.body = record.substr(kStepEnvelopeBytes);
  return envelope;
}

}  // namespace moe
