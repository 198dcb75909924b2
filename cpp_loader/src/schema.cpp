// The artifact schema enforced in C++: the rules of infer/artifact/schema.py over the embedded schema.json.
#include "schema.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <unordered_set>
#include <vector>

#include "embserve/loader.h"
#include "schema_json.h"

namespace embserve::schema {
namespace {

using json = nlohmann::json;
// An echoed value is cut to this many bytes in messages (schema.py: _ECHO).
constexpr size_t kEcho = 64;

[[noreturn]] void fail(const std::string& document, const std::string& path, const std::string& message) {
  throw ManifestError(document + ": " + (path.empty() ? std::string("the document") : path) + " " + message);
}

// Cut at `limit` bytes without splitting a UTF-8 character, saying how long the whole was.
std::string cut(const std::string& text, size_t limit = kEcho) {
  if (text.size() <= limit) return text;
  size_t end = limit;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end) + "\u2026(" + std::to_string(text.size()) + " chars)";
}

// A string as Python's repr would show it: quoted, control bytes escaped (so a message stays one line).
std::string quote(const std::string& value) {
  static const char* hex = "0123456789abcdef";
  std::string out = "'";
  for (unsigned char c : value) {
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7F) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "'";
}

template <typename J>
std::string echo(const J& value) {
  if (value.is_string()) return cut(quote(value.template get_ref<const std::string&>()));
  return cut(value.dump(-1, ' ', false, J::error_handler_t::replace));
}

// A JSON list as Python prints one: ['sum', 'mean'], [1, 16].
std::string py_list(const json& items) {
  std::string out = "[";
  bool first = true;
  for (const auto& item : items) {
    out += first ? "" : ", ";
    first = false;
    out += item.is_string() ? quote(item.get<std::string>()) : item.dump();
  }
  return out + "]";
}

// Numbers compared exactly: a long double holds every int64, uint64 and double.
template <typename J>
long double number(const J& value) {
  if (value.is_number_unsigned()) return static_cast<long double>(value.template get<uint64_t>());
  if (value.is_number_integer()) return static_cast<long double>(value.template get<int64_t>());
  return static_cast<long double>(value.template get<double>());
}

bool is_name(const std::string& value) {
  if (value.empty()) return false;
  for (size_t i = 0; i < value.size(); ++i) {
    const char c = value[i];
    const bool letter = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
    const bool tail = (c >= '0' && c <= '9') || c == '.' || c == '-';
    if (!(letter || (i > 0 && tail))) return false;
  }
  return true;
}

bool is_device(const std::string& value) {
  if (value == "cpu") return true;
  if (value.rfind("cuda:", 0) != 0) return false;
  const std::string digits = value.substr(5);
  if (digits.empty() || digits.size() > 4) return false;
  for (char c : digits)
    if (c < '0' || c > '9') return false;
  return true;
}

bool is_sha256(const std::string& value) {
  if (value.size() != 64) return false;
  for (char c : value)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

bool is_file_name(const std::string& value) {
  if (value.empty() || value == "." || value == "..") return false;
  for (unsigned char c : value)
    if (c == '/' || c == '\\' || c < 0x20 || c == 0x7F) return false;
  return true;
}

// The first byte that is not well-formed UTF-8, or npos.
size_t invalid_utf8_at(const std::string& text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  const size_t size = text.size();
  size_t i = 0;
  while (i < size) {
    const unsigned char c = bytes[i];
    size_t extra;
    unsigned char low = 0x80, high = 0xBF;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      extra = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      extra = 2;
      if (c == 0xE0) low = 0xA0;
      if (c == 0xED) high = 0x9F;  // no UTF-16 surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      extra = 3;
      if (c == 0xF0) low = 0x90;
      if (c == 0xF4) high = 0x8F;
    } else {
      return i;
    }
    for (size_t k = 1; k <= extra; ++k) {
      if (i + k >= size) return i;
      const unsigned char next = bytes[i + k];
      if (next < (k == 1 ? low : 0x80) || next > (k == 1 ? high : 0xBF)) return i;
    }
    i += extra + 1;
  }
  return std::string::npos;
}

class Validator {
 public:
  Validator(const json& definitions, const std::string& document) : definitions_(definitions), document_(document) {}

  void check(const Document& value, const json& rule_in, const std::string& path) const {
    json merged;
    const json* rule = &rule_in;
    if (rule_in.contains("ref")) {  // a definition, with the local keys on top
      merged = definitions_.at(rule_in.at("ref").get<std::string>());
      for (const auto& [key, item] : rule_in.items())
        if (key != "ref") merged[key] = item;
      rule = &merged;
    }
    const std::string declared = rule->at("type").get<std::string>();
    if (value.is_null()) {
      if (rule->value("nullable", false)) return;
      fail(document_, path, "must not be null (expected " + declared + ")");
    }
    std::string kind = declared;
    if (kind == "scalar") kind = value.is_string() ? "string" : "integer";
    if (kind == "any") return;
    if (kind == "object") {
      if (!value.is_object()) fail(document_, path, "must be an object, got " + echo(value));
      const json& properties = rule->at("properties");
      for (const auto& [key, item] : value.items()) {
        if (!properties.contains(key)) {
          json names = json::array();
          for (const auto& [name, unused] : properties.items()) names.push_back(name);  // sorted: json is a map
          fail(document_, path, "has unknown key " + echo(Document(key)) + "; known keys: " + py_list(names));
        }
      }
      if (rule->contains("required"))
        for (const auto& key : rule->at("required"))
          if (!value.contains(key.get<std::string>()))
            fail(document_, path, "lacks the key " + quote(key.get<std::string>()));
      for (const auto& [key, item] : value.items())
        check(item, properties.at(key), path.empty() ? key : path + "." + key);
    } else if (kind == "map") {
      if (!value.is_object()) fail(document_, path, "must be an object, got " + echo(value));
      check_count(value.size(), *rule, path);
      json key_rule = {{"format", rule->at("key_format")}, {"max_length", 255}};
      for (const auto& [key, item] : value.items()) {
        check_string(key, key_rule, path + " key");
        check(item, rule->at("values"), path + "[" + echo(Document(key)) + "]");
      }
    } else if (kind == "array") {
      if (!value.is_array()) fail(document_, path, "must be an array, got " + echo(value));
      check_count(value.size(), *rule, path);
      for (size_t i = 0; i < value.size(); ++i) check(value[i], rule->at("items"), path + "[" + std::to_string(i) + "]");
    } else if (kind == "string") {
      if (!value.is_string()) fail(document_, path, "must be a string, got " + echo(value));
      check_string(value.get_ref<const std::string&>(), *rule, path);
    } else if (kind == "boolean") {
      if (!value.is_boolean()) fail(document_, path, "must be true or false, got " + echo(value));
    } else if (kind == "integer" || kind == "number") {
      // nlohmann keeps 4.0 a float and true a boolean, so neither passes as an integer (as in Python).
      if (kind == "integer" && !value.is_number_integer())
        fail(document_, path, "must be an integer, got " + echo(value));
      if (kind == "number" &&
          !(value.is_number_integer() || (value.is_number_float() && std::isfinite(value.get<double>()))))
        fail(document_, path, "must be a finite number, got " + echo(value));
      const long double got = number(value);
      if (rule->contains("enum")) {
        bool found = false;
        for (const auto& option : rule->at("enum")) found = found || (option.is_number() && number(option) == got);
        if (!found) fail(document_, path, "must be one of " + py_list(rule->at("enum")) + ", got " + echo(value));
      }
      if (rule->contains("minimum") && got < number(rule->at("minimum")))
        fail(document_, path, "must be at least " + rule->at("minimum").dump() + ", got " + echo(value));
      if (rule->contains("maximum") && got > number(rule->at("maximum")))
        fail(document_, path, "must be at most " + rule->at("maximum").dump() + ", got " + echo(value));
      if (rule->contains("multiple_of")) {
        const int64_t step = rule->at("multiple_of").get<int64_t>();
        const bool multiple = value.is_number_unsigned()  ? value.get<uint64_t>() % static_cast<uint64_t>(step) == 0
                              : value.is_number_integer() ? value.get<int64_t>() % step == 0
                                                          : std::fmod(value.get<double>(), static_cast<double>(step)) == 0;
        if (!multiple)
          fail(document_, path, "must be a multiple of " + std::to_string(step) + ", got " + echo(value));
      }
    } else {
      throw ManifestError("schema.json: unknown type '" + kind + "'");  // schema.json is ours
    }
  }

 private:
  void check_count(size_t count, const json& rule, const std::string& path) const {
    const uint64_t min_items = rule.value("min_items", uint64_t{0});
    if (count < min_items)
      fail(document_, path, "needs at least " + std::to_string(min_items) + " entries, has " + std::to_string(count));
    if (rule.contains("max_items") && count > rule.at("max_items").get<uint64_t>())
      fail(document_, path, "has " + std::to_string(count) + " entries, over the limit of " +
                                std::to_string(rule.at("max_items").get<uint64_t>()));
  }

  void check_string(const std::string& value, const json& rule, const std::string& path) const {
    const uint64_t max_length = rule.value("max_length", uint64_t{1} << 20);
    if (value.size() > max_length)
      fail(document_, path, "is " + std::to_string(value.size()) + " bytes long, over the limit of " +
                                std::to_string(max_length));
    if (rule.contains("enum")) {
      bool found = false;
      for (const auto& option : rule.at("enum")) found = found || (option.is_string() && option.get<std::string>() == value);
      if (!found) fail(document_, path, "must be one of " + py_list(rule.at("enum")) + ", got " + cut(quote(value)));
    }
    const std::string format = rule.value("format", std::string("text"));
    if (format == "name" && !is_name(value))
      fail(document_, path,
           "must be a name (letters, digits, _ . -; not starting with a digit), got " + cut(quote(value)));
    if (format == "file_name" && !is_file_name(value))
      fail(document_, path, "must be a plain file name inside the artifact, got " + cut(quote(value)));
    if (format == "device" && !is_device(value))
      fail(document_, path, "must be a device ('cpu' or 'cuda:N'), got " + cut(quote(value)));
    if (format == "sha256" && !is_sha256(value))
      fail(document_, path, "must be 64 lowercase hex digits, got " + cut(quote(value)));
    if (format == "text")
      for (unsigned char c : value)
        if (c < 0x20) fail(document_, path, "must not hold control characters, got " + cut(quote(value)));
  }

  const json& definitions_;
  const std::string& document_;
};

// nlohmann's message without its "[json.exception.parse_error.101] " prefix, control bytes blanked.
std::string reason_of(const std::exception& err) {
  std::string reason = err.what();
  if (auto at = reason.find("] "); at != std::string::npos && reason.rfind("[json.exception", 0) == 0)
    reason = reason.substr(at + 2);
  for (char& c : reason)
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  return reason;
}

// Builds the document from SAX events, keeping the key path of every value so that a parse error
// (1e400, a bad token, a duplicate key) names where it happened.
class DocumentBuilder {
 public:
  using number_integer_t = Document::number_integer_t;
  using number_unsigned_t = Document::number_unsigned_t;
  using number_float_t = Document::number_float_t;
  using string_t = Document::string_t;
  using binary_t = Document::binary_t;

  explicit DocumentBuilder(const std::string& document) : document_(document) {}

  bool null() { return add(Document(nullptr)); }
  bool boolean(bool value) { return add(Document(value)); }
  bool number_integer(number_integer_t value) { return add(Document(value)); }
  bool number_unsigned(number_unsigned_t value) { return add(Document(value)); }
  bool number_float(number_float_t value, const string_t&) { return add(Document(value)); }
  bool string(string_t& value) { return add(Document(value)); }
  bool binary(binary_t&) { return fail(document_, here(), "holds binary data"), false; }
  bool start_object(std::size_t) { return open(Document::object()); }
  bool start_array(std::size_t) { return open(Document::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(string_t& name) {
    Frame& frame = frames_.back();
    if (!frame.keys.insert(name).second)
      fail(document_, frame.path,
           "is not valid JSON (key " + cut(quote(name)) + " appears twice in one object); the file is corrupted");
    frame.key = name;
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& err) {
    // NaN, Infinity and numbers beyond double range (1e400) are parse errors in nlohmann::json
    fail(document_, here(), "is not valid JSON (" + cut(reason_of(err), 200) + "); the file is corrupted");
  }

  Document take() { return std::move(root_); }

 private:
  struct Frame {
    Document* value;
    std::string path;
    std::unordered_set<std::string> keys;
    std::string key;
    size_t items = 0;
  };

  // The key path of the value being read now.
  std::string here() const {
    if (frames_.empty()) return "";
    const Frame& frame = frames_.back();
    if (frame.value->is_array()) return frame.path + "[" + std::to_string(frame.items) + "]";
    if (frame.key.empty() && frame.keys.empty()) return frame.path;
    return frame.path.empty() ? frame.key : frame.path + "." + frame.key;
  }

  Document* place(Document&& value) {
    if (frames_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Frame& frame = frames_.back();
    if (frame.value->is_array()) {
      frame.value->push_back(std::move(value));
      ++frame.items;
      return &frame.value->back();
    }
    Document& slot = (*frame.value)[frame.key];
    slot = std::move(value);
    return &slot;
  }

  bool add(Document&& value) {
    place(std::move(value));
    return true;
  }

  bool open(Document&& container) {
    const std::string path = here();
    Document* value = place(std::move(container));
    frames_.push_back(Frame{value, path, {}, {}, 0});
    return true;
  }

  bool close() {
    frames_.pop_back();
    return true;
  }

  const std::string& document_;
  Document root_;
  std::vector<Frame> frames_;
};

}  // namespace

const json& rules() {
  static const json parsed = json::parse(kSchemaJson);
  return parsed;
}

std::uintmax_t max_bytes(const std::string& which) {
  return rules().at("limits").at(which == "plan" ? "max_plan_bytes" : "max_manifest_bytes").get<std::uintmax_t>();
}

int nesting_depth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {  // UTF-8 multi-byte characters never contain these ASCII bytes
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

Document parse_document(const std::string& data, const std::string& document) {
  if (data.rfind("\xEF\xBB\xBF", 0) == 0) fail(document, "", "starts with a byte-order mark; write plain UTF-8");
  if (size_t at = invalid_utf8_at(data); at != std::string::npos)
    fail(document, "", "is not UTF-8 (invalid byte at byte " + std::to_string(at) + ")");
  const int limit = rules().at("limits").at("max_depth").get<int>();
  if (int depth = nesting_depth(data); depth > limit)
    fail(document, "",
         "nests " + std::to_string(depth) + " levels deep, over the limit of " + std::to_string(limit) +
             "; the file is corrupted");
  DocumentBuilder builder(document);
  try {
    Document::sax_parse(data, &builder, nlohmann::detail::input_format_t::json, /*strict=*/true,
                        /*ignore_comments=*/false);
  } catch (const ManifestError&) {
    throw;
  } catch (const nlohmann::json::exception& err) {  // the builder reports parse errors itself; this is a backstop
    fail(document, "", "is not valid JSON (" + cut(reason_of(err), 200) + "); the file is corrupted");
  }
  return builder.take();
}

void validate(const Document& value, const std::string& which, const std::string& document) {
  const json& root = rules();
  Validator(root.at("definitions"), document).check(value, root.at(which), "");
}

}  // namespace embserve::schema
