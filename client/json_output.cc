#include "client/json_output.h"

#include <cstdio>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/json_util.h"

namespace moe {
namespace client {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

bool Is64Bit(const FieldDescriptor* field) {
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
    case FieldDescriptor::CPPTYPE_UINT64:
      return true;
    default:
      return false;
  }
}

Json Number(const FieldDescriptor* field, const Json& value) {
  if (!value.is_string()) return value;
  const std::string& s = value.get_ref<const std::string&>();
  if (field->cpp_type() == FieldDescriptor::CPPTYPE_UINT64) return Json(std::stoull(s));
  return Json(static_cast<int64_t>(std::stoll(s)));
}

// protobuf's JSON writes 64-bit integers as strings (JavaScript's doubles cannot hold them);
// moectl's readers are shells and Python, which read numbers: convert them back, walking the
// message's descriptor next to the JSON.
void Numbers(const Descriptor* descriptor, Json* object) {
  if (!object->is_object()) return;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    auto it = object->find(field->name());
    if (it == object->end()) continue;
    Json& value = *it;
    const bool map = field->is_map();
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && !map) {
      if (field->is_repeated() && value.is_array()) {
        for (Json& item : value) Numbers(field->message_type(), &item);
      } else {
        Numbers(field->message_type(), &value);
      }
    } else if (Is64Bit(field)) {
      if (field->is_repeated() && value.is_array()) {
        for (Json& item : value) item = Number(field, item);
      } else {
        value = Number(field, value);
      }
    }
  }
}

}  // namespace

Json ProtoToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string text;
  if (!google::protobuf::util::MessageToJsonString(message, &text, options).ok()) {
    return Json::object();
  }
  Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return Json::object();
  Numbers(message.GetDescriptor(), &json);
  return json;
}

void PrintJson(const Json& value, int indent) {
  // Invalid UTF-8 (a file name, a server message) is replaced, never an exception.
  std::printf("%s\n", value.dump(indent, ' ', false, Json::error_handler_t::replace).c_str());
}

}  // namespace client
}  // namespace moe
