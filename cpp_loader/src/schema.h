// The artifact schema (infer/artifact/schema.json, embedded at build time) and its validator.
//
// The same rules as infer/artifact/schema.py, so the C++ and Python loaders accept and reject the same
// manifest.json and plan.json: no byte-order mark, UTF-8, nesting within limits.max_depth (checked
// before parsing), no NaN/Infinity or numbers out of double range, no duplicate keys; then types,
// ranges, required and unknown keys, string formats. Every violation is a ManifestError naming the
// document and the key path.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace embserve::schema {

// Documents keep their keys in file order, so the first violation reported is the one Python reports.
using Document = nlohmann::ordered_json;

// schema.json, parsed once.
const nlohmann::json& rules();

// limits.max_manifest_bytes / limits.max_plan_bytes.
std::uintmax_t max_bytes(const std::string& which);

// Bytes of manifest.json or plan.json -> JSON value. Throws ManifestError("<document>: ...").
Document parse_document(const std::string& data, const std::string& document);

// Check a parsed document against schema.json's `which` ("manifest" or "plan"). Throws ManifestError.
void validate(const Document& value, const std::string& which, const std::string& document);

// Deepest nesting of objects and arrays in a JSON text (brackets inside strings do not count).
int nesting_depth(const std::string& text);

}  // namespace embserve::schema
