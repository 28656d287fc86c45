// JSON that moectl prints, through nlohmann::json (Debian's nlohmann-json3-dev): objects keep
// their keys in insertion order, strings are escaped by the library, and int64 values are
// numbers, also those of protobuf messages (protobuf's own JSON writes them as strings).
//
//   Json out;
//   out["layer"] = name;
//   out["step_id"] = step_id;
//   out["status"] = ProtoToJson(status_message);
//   PrintJson(out);
#ifndef MOED_CLIENT_JSON_OUTPUT_H_
#define MOED_CLIENT_JSON_OUTPUT_H_

#include <cmath>

#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace client {

using Json = nlohmann::ordered_json;

// A message's fields by their proto names, every field printed (defaults too); 64-bit integers
// as JSON numbers.
Json ProtoToJson(const google::protobuf::Message& message);

// One line on stdout (`indent` > 0: pretty, for the human-facing commands).
void PrintJson(const Json& value, int indent = -1);

// Milliseconds and rates rounded to 3 decimals for printing.
inline double Round3(double v) { return std::round(v * 1000.0) / 1000.0; }

}  // namespace client
}  // namespace moe

#endif  // MOED_CLIENT_JSON_OUTPUT_H_
