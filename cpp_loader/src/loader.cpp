// embserve::Model: manifest checks, fbgemm library loading, TorchScript load and validated lookups.
#include "embserve/loader.h"

#include <dlfcn.h>
#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <sstream>
#include <thread>

#include <ATen/Parallel.h>
// torch 2.11's headers reach these ops through no other include here (2.13's do)
#include <ATen/ops/cat.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>  // torch::jit::load (<torch/script.h> adds 5 CPU-s of headers)
#include <torch/cuda.h>
#include <torch/version.h>

#include "files.h"
#include "hot_rows.h"
#include "prefetch.h"
#include "kernel_attributes_json.h"
#include "schema.h"

#ifndef EMBSERVE_FBGEMM_DIR
#define EMBSERVE_FBGEMM_DIR ""
#endif

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace embserve {
namespace {

// The manifest versions this loader reads (infer/artifact/manifest.py): 2, every weight inside model.pt; 3, each CPU
// kernel's weight buffer in a file of the artifact, mapped read-only.
constexpr int kFormatVersion = 2;
constexpr int kMappedFormatVersion = 3;
constexpr const char* kRequestPrefix = "embserve.RequestError: ";

std::string first_line(const std::string& text) {
  auto end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

// An exception's message without c10's C++ backtrace ("Exception raised from ... frame #0 ...").
std::string message_of(const std::exception& err) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&err)) return c10_error->what_without_backtrace();
  return err.what();
}

// infer.artifact.manifest.missing_manifest, word for word: where the manifest was looked for, and, when the folder
// holds an artifact's other files (model.pt, model.pt2, model.onnx, plan.json, weights-<n>.bin), that it is an
// artifact whose manifest is gone.
std::string missing_manifest(const fs::path& path) {
  const fs::path folder = path.parent_path();
  std::vector<std::string> held;
  std::error_code ec;
  for (const char* name : {"model.pt", "model.pt2", "model.onnx", "plan.json"})
    if (fs::is_regular_file(folder / name, ec)) held.emplace_back(name);
  std::vector<std::string> weights;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("weights-", 0) == 0 && name.size() >= 12 && name.compare(name.size() - 4, 4, ".bin") == 0 &&
        it->is_regular_file(ec))
      weights.push_back(name);
  }
  std::sort(weights.begin(), weights.end());
  held.insert(held.end(), weights.begin(), weights.end());
  if (held.empty()) return path.string() + " is missing; " + folder.string() + " is not an embserve artifact";
  std::string shown;
  for (size_t i = 0; i < std::min<size_t>(held.size(), 4); ++i) shown += (i ? ", " : "") + held[i];
  if (held.size() > 4) shown += " and " + std::to_string(held.size() - 4) + " more";
  return path.string() + " is missing: " + folder.string() + " holds an artifact's files (" + shown +
         ") but not its manifest, which export writes last; the export did not finish or manifest.json was "
         "removed: re-export the artifact";
}

// manifest.json or plan.json: size cap, then schema.cpp's parse (BOM, UTF-8, depth, duplicates, NaN) and rules.
schema::Document read_document(const fs::path& path, const std::string& which) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    if (which == "manifest") throw ManifestError(missing_manifest(path));
    throw ManifestError(path.string() + " is missing from the artifact");
  }
  const auto size = fs::file_size(path, ec);
  const auto cap = schema::max_bytes(which);
  if (ec || size > cap)
    throw ManifestError(path.string() + " is " + std::to_string(size) + " bytes, over the " + std::to_string(cap) +
                        "-byte cap");
  std::ifstream in(path, std::ios::binary);
  std::string bytes(static_cast<size_t>(size), '\0');
  if (!in.read(bytes.data(), static_cast<std::streamsize>(size)))
    throw ManifestError(path.string() + " cannot be read");
  schema::Document data = schema::parse_document(bytes, path.string());
  if (!data.is_object()) throw ManifestError(path.string() + " is not a JSON object");
  if (which == "manifest" && data.is_object() && data.value("format", schema::Document()) != "embserve-artifact")
    throw ManifestError(path.string() + " is not an embserve manifest (format=" +
                        data.value("format", schema::Document()).dump(-1, ' ', false, json::error_handler_t::replace)
                            .substr(0, 64) + ")");
  if (which == "manifest" && data.is_object() && data.contains("format_version") &&
      data["format_version"].is_number_integer() && data["format_version"] != kFormatVersion &&
      data["format_version"] != kMappedFormatVersion)
    throw ManifestError(path.string() + " has format_version " + data["format_version"].dump() +
                        "; this loader reads versions " + std::to_string(kFormatVersion) + " and " +
                        std::to_string(kMappedFormatVersion) + ". Re-export the model with a matching embserve");
  schema::validate(data, which, path.string());
  return data;
}

int data_type_code(const std::string& type) {  // SparseType
  if (type == "fp32") return 0;
  if (type == "fp16") return 1;
  if (type == "int8") return 2;
  if (type == "int4") return 3;
  return 4;  // int2 (the schema allows no other)
}

int64_t data_type_bits(const std::string& type) {
  if (type == "fp32") return 32;
  if (type == "fp16") return 16;
  if (type == "int8") return 8;
  if (type == "int4") return 4;
  return 2;
}

int64_t round_up(int64_t value, int64_t step) { return (value + step - 1) / step * step; }

// Bytes the TBE allocates for one table of a manifest kernel (infer.quant.rowwise.table_bytes): rows of
// data + 4 scale/bias bytes for integer types, aligned, the table rounded up to 128 bytes.
int64_t table_bytes(const schema::Document& table, int64_t alignment) {
  const auto type = table["data_type"].get<std::string>();
  const int64_t rows = table["rows"].get<int64_t>(), dim = table["dim"].get<int64_t>();
  const int64_t scale_bias = (type == "int8" || type == "int4" || type == "int2") ? 4 : 0;
  const int64_t row_bytes = round_up(dim * data_type_bits(type) / 8 + scale_bias, alignment);
  return round_up(rows * row_bytes, 128);  // rows < 2^31, row bytes < 2^14: no overflow
}

bool is_mapped(const schema::Document& data) { return data["format_version"] == kMappedFormatVersion; }

// A kernel's weight buffer as the manifest places it (`shared_storage` or version 3's `weights`), as one text
// to compare; empty when the kernel owns a buffer laid out table after table.
std::string storage_of(const schema::Document& kernel) {
  std::string text;
  if (kernel.contains("shared_storage"))
    text += "shared_storage " + kernel["shared_storage"]["bytes"].dump() + " " +
            kernel["shared_storage"]["table_offsets"].dump();
  if (kernel.contains("weights")) {
    const auto& weights = kernel["weights"];
    text += "weights " + weights["file"].dump() + " " + weights["offset"].dump() + " " + weights["bytes"].dump() +
            " " + weights["table_offsets"].dump();
  }
  return text;
}

// Each table's (first byte, bytes) in a kernel's weight buffer as an embedded artifact lays it out
// (infer.artifact.mapped._table_places): the shared buffer's places, else the tables one after another.
std::vector<std::pair<int64_t, int64_t>> table_places(const schema::Document& kernel) {
  const int64_t alignment = kernel["row_alignment"].get<int64_t>();
  const bool shared = kernel.contains("shared_storage");
  std::vector<std::pair<int64_t, int64_t>> places;
  int64_t cursor = 0;
  for (size_t t = 0; t < kernel["tables"].size(); ++t) {
    const int64_t size = table_bytes(kernel["tables"][t], alignment);
    places.emplace_back(shared ? kernel["shared_storage"]["table_offsets"][t].get<int64_t>() : cursor, size);
    cursor += size;
  }
  return places;
}

// infer.artifact.mapped.place_weights over the CPU kernels `indices` of `kernels` (embedded layouts, in kernel
// order): each distinct weight buffer (all kernels sharing one, else each kernel's own) goes to file
// `<prefix>weights-<n>.bin`, its distinct tables page-aligned in the order of their embedded places; each kernel
// gets `weights` = {file, offset 0, the file's bytes, its tables' new places} instead of `shared_storage`.
void place_weights(schema::Document& kernels, const std::vector<size_t>& indices, const std::string& prefix) {
  std::vector<size_t> shared;
  for (const size_t i : indices)
    if (kernels[i].contains("shared_storage")) shared.push_back(i);
  std::vector<std::vector<size_t>> groups;
  for (const size_t i : indices) {
    if (!kernels[i].contains("shared_storage"))
      groups.push_back({i});
    else if (i == shared.front())
      groups.push_back(shared);
  }
  for (size_t number = 0; number < groups.size(); ++number) {
    std::map<size_t, std::vector<std::pair<int64_t, int64_t>>> places;
    std::map<int64_t, int64_t> sizes;  // embedded start -> bytes, in order
    for (const size_t i : groups[number]) {
      places[i] = table_places(kernels[i]);
      for (const auto& [start, size] : places[i]) sizes[start] = size;
    }
    std::map<int64_t, int64_t> moved;
    int64_t cursor = 0;
    for (const auto& [start, size] : sizes) {
      cursor = files::page_round_up(cursor);
      moved[start] = cursor;
      cursor += size;
    }
    for (const size_t i : groups[number]) {
      std::vector<int64_t> offsets;
      for (const auto& place : places[i]) offsets.push_back(moved[place.first]);
      kernels[i].erase("shared_storage");
      // infer/storage/layout.py WEIGHTS_FILE_PATTERN
      kernels[i]["weights"] = {{"file", prefix + "weights-" + std::to_string(number) + ".bin"},
                               {"offset", 0},
                               {"bytes", cursor},
                               {"table_offsets", offsets}};
    }
  }
}

// Version 3 keeps every CPU kernel's weights in a listed file, inside it; version 2 none
// (infer.artifact.manifest.Manifest._check_weight_files, same order, same words).
template <typename Fail, typename NeedsChecksum>
void check_weight_files(const schema::Document& data, const Fail& fail, const NeedsChecksum& needs_checksum) {
  const auto& kernels = data["kernels"];
  const bool mapped = is_mapped(data);
  for (size_t k = 0; k < kernels.size(); ++k) {
    const auto& kernel = kernels[k];
    const std::string where = "kernels[" + std::to_string(k) + "]";
    const bool has_weights = kernel.contains("weights");
    if (has_weights && kernel.contains("shared_storage")) fail(where + " has both 'weights' and 'shared_storage'");
    if (!mapped) {
      if (has_weights)
        fail(where + ".weights needs format_version " + std::to_string(kMappedFormatVersion) +
             " (this manifest says " + data["format_version"].dump() + "); the manifest is corrupted");
      continue;
    }
    if (has_weights != (kernel["device"] == "cpu"))
      fail(where + ": format_version " + std::to_string(kMappedFormatVersion) + " keeps each CPU kernel's weights " +
           "(and only theirs) in a weight file ('weights'); the manifest is corrupted");
    if (!has_weights) continue;
    const auto& weights = kernel["weights"];
    needs_checksum(weights["file"]);
    const auto name = weights["file"].get<std::string>();
    const int64_t first = weights["offset"].get<int64_t>(), size = weights["bytes"].get<int64_t>();
    const int64_t file_bytes = data["files"][name]["bytes"].get<int64_t>();
    if (first % files::kPageBytes != 0 || first + size > file_bytes)
      fail(where + ".weights: bytes " + std::to_string(first) + ".." + std::to_string(first + size) +
           " do not lie page-aligned inside " + name + " (" + std::to_string(file_bytes) +
           " bytes); the manifest is corrupted");
  }
}

// dense.expects (the pooled layout the dense part was trained on, infer.dense_layout) must be exactly the layout
// 'features' gives: the same features, tables, pooling and columns, in the same order (as Python's
// PooledLayout.mismatches); else the dense part would read wrong columns. Names the first entry that differs.
template <typename Fail>
void check_dense_expects(const schema::Document& dense, const schema::Document& features, const Fail& fail) {
  if (!dense["present"].get<bool>()) fail("dense.expects is set but dense.present is false");
  const auto& expects = dense["expects"]["features"];
  auto describe = [](const schema::Document& f) {
    return "feature '" + f["name"].get<std::string>() + "' (table '" + f["table"].get<std::string>() + "', pooled " +
           f["pooling"].get<std::string>() + ", columns " + f["column_start"].dump() + ":" + f["column_end"].dump() +
           ")";
  };
  const std::string problem = "dense.expects disagrees with 'features': ";
  const std::string fix = "; the dense part was trained on another pooled layout: re-export with the spec it was "
                          "trained with (infer.from_torchrec)";
  for (size_t i = 0; i < std::max(expects.size(), features.size()); ++i) {
    const std::string where = "dense.expects.features[" + std::to_string(i) + "]";
    if (i >= expects.size()) fail(problem + "'features' goes on with " + describe(features[i]) + ", " + where +
                                  " is missing" + fix);
    if (i >= features.size()) fail(problem + where + " is " + describe(expects[i]) + ", 'features' ends before it" +
                                   fix);
    for (const char* key : {"name", "table", "pooling", "column_start", "column_end"})
      if (expects[i][key] != features[i][key])
        fail(problem + where + " is " + describe(expects[i]) + ", 'features' has " + describe(features[i]) + fix);
  }
}

// A table held in precision blocks (tables[].blocks, ranked hottest first): a few blocks, each but the last (cold)
// one in int32 rows, together the table's rows (infer.config._parse_blocks, same words after "tables: ").
template <typename Fail>
void check_blocks(const schema::Document& table, const Fail& fail) {
  const auto name = table["name"].get<std::string>();
  const auto& blocks = table["blocks"];
  int64_t total = 0;
  bool small = blocks.size() <= 7;
  for (size_t j = 0; j < blocks.size(); ++j) {
    const int64_t rows = blocks[j]["rows"].get<int64_t>();
    total += rows;
    small = small && (j + 1 == blocks.size() || rows < (int64_t{1} << 28));
  }
  if (!small)
    fail("tables: table '" + name + "': " + std::to_string(blocks.size()) + " blocks; a table holds at most 7 " +
         "blocks, each but the last (cold) one under 2**28 rows");
  const int64_t rows = table["num_embeddings"].get<int64_t>();
  if (total != rows)
    fail("tables: table '" + name + "': blocks hold " + std::to_string(total) + " rows but the table has " +
         std::to_string(rows) + "; make the blocks' rows add up to num_embeddings");
}

// block_remaps: one id remap per block table, in table order, as many entries as the table has rows
// (infer.artifact.manifest.Manifest._check_block_remaps, same words).
template <typename Fail>
void check_block_remaps_listed(const schema::Document& data, const Fail& fail) {
  std::vector<std::string> block_tables, listed;
  std::map<std::string, int64_t> rows;
  for (const auto& table : data["tables"]) {
    const auto name = table["name"].get<std::string>();
    rows[name] = table["num_embeddings"].get<int64_t>();
    if (table.contains("blocks")) block_tables.push_back(name);
  }
  const schema::Document empty = schema::Document::object();
  const auto& remaps = data.contains("block_remaps") ? data["block_remaps"] : empty;
  for (const auto& item : remaps.items()) listed.push_back(item.key());
  if (listed != block_tables) {
    // Python names the first missing table, else the first extra name, else the order
    auto absent = [](const std::vector<std::string>& from, const std::vector<std::string>& in) -> std::string {
      for (const auto& name : from)
        if (std::find(in.begin(), in.end(), name) == in.end()) return name;
      return "";
    };
    const std::string missing = absent(block_tables, listed), extra = absent(listed, block_tables);
    std::string which = "block_remaps is not in table order";
    if (!missing.empty()) which = "table '" + missing + "' is held in blocks but has no remap";
    else if (!extra.empty()) which = "block_remaps names '" + extra + "', which 'tables' does not hold in blocks";
    fail(which + "; block_remaps disagrees with 'tables'");
  }
  for (const auto& item : remaps.items()) {
    const std::string& name = item.key();
    const auto& entry = item.value();
    if (entry["rows"].get<int64_t>() != rows[name])
      fail("block_remaps['" + name + "'] has " + entry["rows"].dump() + " ranks but table '" + name + "' has " +
           std::to_string(rows[name]) + " rows; block_remaps disagrees with 'tables'");
  }
}

// The rules that tie the manifest's parts together (as infer.artifact.manifest.Manifest.from_dict).
// Runs after schema::validate, so every key exists with its type.
void check_manifest(const schema::Document& data, const std::string& document) {
  auto fail = [&](const std::string& message) { throw ManifestError(document + ": " + message); };
  const auto& tables = data["tables"];
  std::set<std::string> table_names, feature_names;
  std::vector<std::string> order;
  int64_t column = 0;
  size_t f = 0;
  const auto& features = data["features"];
  for (size_t t = 0; t < tables.size(); ++t) {
    const auto& table = tables[t];
    const auto name = table["name"].get<std::string>();
    if (!table_names.insert(name).second) fail("tables[" + std::to_string(t) + "].name '" + name + "' appears twice");
    if (table.contains("blocks")) check_blocks(table, fail);
    for (const auto& feature_name : table["feature_names"]) {
      const auto fname = feature_name.get<std::string>();
      if (!feature_names.insert(fname).second)
        fail("tables[" + std::to_string(t) + "].feature_names: feature '" + fname + "' appears twice");
      const std::string where = "features[" + std::to_string(f) + "]";
      if (f >= features.size()) fail("'features' lists " + std::to_string(features.size()) +
                                     " features but 'tables' name more; 'features' disagrees with 'tables'");
      const auto& got = features[f];
      const int64_t dim = table["embedding_dim"].get<int64_t>();
      auto differs = [&](const char* key, const schema::Document& expected) {
        if (got[key] != expected)
          fail(where + "." + key + " is " + got[key].dump() + " but 'tables' imply " + expected.dump() +
               "; 'features' disagrees with 'tables'");
      };
      differs("name", fname);
      differs("table", name);
      differs("num_embeddings", table["num_embeddings"]);
      differs("embedding_dim", table["embedding_dim"]);
      differs("pooling", table["pooling"]);
      differs("column_start", column);
      differs("column_end", column + dim);
      column += dim;
      order.push_back(fname);
      ++f;
    }
  }
  if (f != features.size())
    fail("'features' lists " + std::to_string(features.size()) + " features but 'tables' name " +
         std::to_string(f) + "; 'features' disagrees with 'tables'");
  if (data["input_schema"]["feature_order"].get<std::vector<std::string>>() != order)
    fail("input_schema.feature_order differs from the features' order in 'tables'");
  // in the order of Python's Manifest._check_consistency, so both report the same first problem
  const auto& output_shape = data["output"]["shape"];
  if (output_shape.empty() || output_shape.back() != column)
    fail("output.shape must end with the output dim " + std::to_string(column));
  const auto& dense = data["dense"];
  const bool has_dense = dense["present"].get<bool>();
  if (has_dense && dense["num_dense_features"].get<int64_t>() < 1)
    fail("dense.present is true but dense.num_dense_features is 0; a dense part needs at least one input");
  if (dense.contains("expects")) check_dense_expects(dense, features, fail);
  // a listed file without a checksum is a ChecksumError, as in Python
  const auto& files = data["files"];
  auto needs_checksum = [&](const schema::Document& name) {
    if (!files.contains(name.get<std::string>()))
      throw ChecksumError(document + " has no checksum for " + name.get<std::string>());
  };
  needs_checksum(data["model_file"]);
  const auto& sharding = data["sharding"];
  const int64_t world_size = sharding["world_size"].get<int64_t>();
  if (world_size > 1 && sharding["plan_file"].is_null())
    fail("sharding.world_size is " + std::to_string(world_size) + " but sharding.plan_file is null");
  if (!sharding["plan_file"].is_null()) needs_checksum(sharding["plan_file"]);
  if (data.contains("onnx")) {  // the artifact also carries model.onnx (not loaded here, but listed and hashed)
    const auto& onnx = data["onnx"];
    needs_checksum(onnx["model_file"]);
    for (const auto& name : onnx["data_files"]) needs_checksum(name);
    if (!onnx["dense_file"].is_null()) needs_checksum(onnx["dense_file"]);
    if (onnx["dense_file"].is_null() == has_dense)
      fail("onnx.dense_file must be set exactly when dense.present is true");
  }
  if (data.contains("pt2")) needs_checksum(data["pt2"]["file"]);  // model.pt2 (the Pt2 backend's program)
  check_weight_files(data, fail, needs_checksum);
  check_block_remaps_listed(data, fail);
  // kernels: each feature_table_map entry names one of its kernel's tables; the row alignment is the device's
  const auto& kernels = data["kernels"];
  for (size_t k = 0; k < kernels.size(); ++k) {
    const auto& kernel = kernels[k];
    const std::string where = "kernels[" + std::to_string(k) + "]";
    const auto device = kernel["device"].get<std::string>();
    const int64_t alignment = kernel["row_alignment"].get<int64_t>();
    if (alignment != (device == "cpu" ? 1 : 16))
      fail(where + ".row_alignment " + std::to_string(alignment) + " is not the kernel's for " + device +
           " (1 on CPU, 16 on CUDA)");
    const auto num_tables = kernel["tables"].size();
    for (size_t i = 0; i < kernel["feature_table_map"].size(); ++i)
      if (kernel["feature_table_map"][i].get<uint64_t>() >= num_tables)
        fail(where + ".feature_table_map[" + std::to_string(i) + "] is " + kernel["feature_table_map"][i].dump() +
             " but the kernel has " + std::to_string(num_tables) + " tables");
  }
  if (sharding["plan_file"].is_null()) {
    // unsharded: one kernel holding every table, features mapped to their tables in order; a table held in
    // precision blocks is one kernel table per block, and the kernel reads every feature once per level, level 0
    // at its table's cold (last) block, level k >= 1 at its (k-1)-th block or, past its blocks, its cold block
    // (infer.artifact.kernels.expected_kernels, infer.modules.collection.kernel_features)
    if (kernels.size() != 1) fail("an unsharded model has one kernel; 'kernels' lists " + std::to_string(kernels.size()));
    const auto& kernel = kernels[0];
    std::vector<std::vector<uint64_t>> kernel_tables;  // per table, its kernel tables (one per block)
    schema::Document expected_tables = schema::Document::array();
    std::vector<size_t> owner;  // per kernel table, its table
    std::vector<size_t> feature_tables;  // per feature, its table
    for (size_t t = 0; t < tables.size(); ++t) {
      const auto& want = tables[t];
      kernel_tables.emplace_back();
      auto add = [&](const schema::Document& rows, const schema::Document& type) {
        kernel_tables.back().push_back(expected_tables.size());
        expected_tables.push_back({{"rows", rows}, {"dim", want["embedding_dim"]}, {"data_type", type}});
        owner.push_back(t);
      };
      if (want.contains("blocks"))
        for (const auto& block : want["blocks"]) add(block["rows"], block["data_type"]);
      else
        add(want["num_embeddings"], want["data_type"]);
      for (size_t i = 0; i < want["feature_names"].size(); ++i) feature_tables.push_back(t);
    }
    if (kernel["tables"].size() != expected_tables.size())
      fail("kernels[0] has " + std::to_string(kernel["tables"].size()) + " tables; 'tables' has " +
           std::to_string(expected_tables.size()) + (expected_tables.size() != tables.size() ? " (a table per block)" : ""));
    for (size_t i = 0; i < expected_tables.size(); ++i) {
      const auto& got = kernel["tables"][i];
      const auto& want = expected_tables[i];
      if (got["rows"] != want["rows"] || got["dim"] != want["dim"] || got["data_type"] != want["data_type"])
        fail("kernels[0].tables[" + std::to_string(i) + "] " + got.dump() + " differs from " +
             (expected_tables.size() != tables.size() ? want.dump() + ", " : "") + "tables[" +
             std::to_string(owner[i]) + "] ('" + tables[owner[i]]["name"].get<std::string>() + "')");
    }
    size_t levels = 1;
    for (const auto& blocks : kernel_tables) levels = std::max(levels, blocks.size());
    std::vector<uint64_t> expected_map;
    for (size_t k = 0; k < levels; ++k)
      for (const size_t t : feature_tables) {
        const auto& blocks = kernel_tables[t];
        expected_map.push_back(blocks[k == 0 || k >= blocks.size() ? blocks.size() - 1 : k - 1]);
      }
    if (kernel["feature_table_map"].get<std::vector<uint64_t>>() != expected_map)
      fail("kernels[0].feature_table_map differs from the features' tables");
    // its buffer: its own, tables one after another; version 3: that buffer page-aligned in weights-0.bin
    schema::Document expected = schema::Document::array();
    expected.push_back({{"row_alignment", kernel["row_alignment"]}, {"tables", kernel["tables"]}});
    if (is_mapped(data) && kernel["device"] == "cpu") place_weights(expected, {0}, "");
    if (storage_of(kernel) != storage_of(expected[0]))
      fail("'kernels' disagrees with 'tables' (an unsharded model has one kernel holding every table)");
  }
}

// plan.json against the manifest, with the rules of infer.shard.builder.check_plan and device_layouts
// (the Python loader's verify_plan): the plan places exactly the manifest's tables, whole, with their data
// types, on the manifest's world size; and the kernels it implies (one per rank holding a shard: local
// tables in table order then shard order, features sorted by input feature, output column and row
// block) are exactly the manifest's `kernels`.
// Per kernel feature, as DeviceShards keeps it: {feature, kind, lo, hi, out_col, dim} (kind: 0 read all,
// 1 row block [lo, hi), 2 replica lo of hi).
using Routing = std::vector<std::array<int64_t, 6>>;

std::vector<Routing> check_plan(const schema::Document& plan, const schema::Document& data,
                                const std::string& document) {
  auto fail = [&](const std::string& message) { throw ManifestError(document + ": " + message); };
  const auto& tables = data["tables"];
  std::map<std::string, size_t> table_index;
  std::vector<std::string> model_names, planned_names;
  for (size_t t = 0; t < tables.size(); ++t) {
    table_index[tables[t]["name"].get<std::string>()] = t;
    model_names.push_back(tables[t]["name"].get<std::string>());
  }
  for (const auto& entry : plan["tables"]) planned_names.push_back(entry["table"].get<std::string>());
  std::sort(model_names.begin(), model_names.end());
  std::sort(planned_names.begin(), planned_names.end());
  if (planned_names != model_names)
    fail("the plan's tables are not the model's (" + std::to_string(planned_names.size()) + " planned, " +
         std::to_string(model_names.size()) + " in the manifest, or other names)");
  const int64_t plan_world_size = plan["topology"]["world_size"].get<int64_t>();
  std::map<std::string, const schema::Document*> plan_of;
  for (const auto& entry : plan["tables"]) {
    const auto name = entry["table"].get<std::string>();
    plan_of[name] = &entry;
    const auto& table = tables[table_index[name]];
    const auto type = table["data_type"].get<std::string>();
    const int64_t rows = table["num_embeddings"].get<int64_t>(), dim = table["embedding_dim"].get<int64_t>();
    if (entry["data_type"].get<std::string>() != type)
      fail("table '" + name + "': plan says " + entry["data_type"].get<std::string>() + ", model is " + type);
    // a table in precision blocks goes whole to one device: its remap and blocks are one kernel's
    // (infer.shard.builder.block_sharding_refused, same words)
    if (const auto sharding = entry["sharding_type"].get<std::string>(); table.contains("blocks") && sharding != "table_wise")
      fail("table '" + name + "': the plan shards it " + sharding + ", but " +
           (sharding == "replicated" ? "replicating a table in precision blocks"
                                     : "row-wise/column-wise sharding of a table in precision blocks") +
           " is not supported; shard it table-wise or store it in one type");
    const int64_t per_byte = 8 / std::min<int64_t>(data_type_bits(type), 8);
    // infer.shard.builder's _table_size and _shard_text, word for word
    const std::string table_size = std::to_string(rows) + " rows x " + std::to_string(dim) + " columns";
    auto shard_text = [](const schema::Document& shard) {
      const int64_t row_offset = shard["row_offset"].get<int64_t>(), col_offset = shard["col_offset"].get<int64_t>();
      return "the shard on device " + std::to_string(shard["device"].get<int64_t>()) + " (rows [" +
             std::to_string(row_offset) + ", " + std::to_string(row_offset + shard["num_rows"].get<int64_t>()) +
             "), columns [" + std::to_string(col_offset) + ", " +
             std::to_string(col_offset + shard["num_cols"].get<int64_t>()) + "))";
    };
    std::vector<std::pair<int64_t, int64_t>> row_ranges, col_ranges;
    for (const auto& shard : entry["shards"]) {
      const int64_t device = shard["device"].get<int64_t>();
      const int64_t row_offset = shard["row_offset"].get<int64_t>(), num_rows = shard["num_rows"].get<int64_t>();
      const int64_t col_offset = shard["col_offset"].get<int64_t>(), num_cols = shard["num_cols"].get<int64_t>();
      if (device >= plan_world_size)
        fail("table '" + name + "': shard on device " + std::to_string(device) + " outside the topology");
      if (row_offset + num_rows > rows || col_offset + num_cols > dim)
        fail("table '" + name + "': " + shard_text(shard) + " lies outside the table's " + table_size);
      if (col_offset % std::max<int64_t>(per_byte, 4) != 0 || num_cols % 4 != 0)
        fail("table '" + name + "': column slice " + std::to_string(col_offset) + "+" + std::to_string(num_cols) +
             " is not 4-column aligned");
      row_ranges.emplace_back(row_offset, num_rows);
      col_ranges.emplace_back(col_offset, num_cols);
    }
    std::sort(row_ranges.begin(), row_ranges.end());
    std::sort(col_ranges.begin(), col_ranges.end());
    auto covers = [](const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t total) {
      int64_t position = 0;
      for (const auto& [offset, size] : ranges) {
        if (offset != position) return false;
        position += size;
      }
      return position == total;
    };
    auto all_equal = [](const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t total) {
      return std::all_of(ranges.begin(), ranges.end(), [&](const auto& r) { return r.first == 0 && r.second == total; });
    };
    const auto kind = entry["sharding_type"].get<std::string>();
    bool covered;
    if (kind == "row_wise" || kind == "table_row_wise")
      covered = covers(row_ranges, rows) && all_equal(col_ranges, dim);
    else if (kind == "column_wise")
      covered = covers(col_ranges, dim) && all_equal(row_ranges, rows);
    else
      covered = all_equal(row_ranges, rows) && all_equal(col_ranges, dim) &&
                (kind != "table_wise" || entry["shards"].size() == 1);
    if (!covered) {
      std::string placed;
      size_t shown = 0;
      for (const auto& shard : entry["shards"]) {
        if (shown == 4) {
          placed += "; ...";
          break;
        }
        placed += (shown++ ? "; " : "") + shard_text(shard);
      }
      fail("table '" + name + "': " + kind + " shards do not cover the table's " + table_size + " exactly (" + placed +
           ")");
    }
  }
  const int64_t world_size = data["sharding"]["world_size"].get<int64_t>();
  if (plan_world_size != world_size)
    fail("plans " + std::to_string(plan_world_size) + " devices, the manifest says sharding.world_size " +
         std::to_string(world_size));

  // the kernels the plan implies, as shard_model builds them
  const int64_t alignment = plan["topology"]["compute_device"] == "cuda" ? 16 : 1;
  const auto& features = data["features"];
  schema::Document expected = schema::Document::array();
  std::vector<Routing> routing;
  // per expected kernel, per local table: the shard's identity (table index, row offset, column offset, rows,
  // columns, precision block or -1), which also orders the shared buffer (infer.shard.builder.shared_cpu_storage)
  using ShardKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
  std::vector<std::vector<ShardKey>> shard_keys;
  std::vector<int64_t> kernel_ranks;  // per expected kernel: its plan rank
  const auto& topology = plan["topology"];
  const bool one_host = !topology.contains("local_world_size") ||
                        topology["local_world_size"].get<int64_t>() >= topology["world_size"].get<int64_t>();
  // One CPU host: a row- or column-wise shard is a view of its whole table (stored once), read for its share of
  // the batch like a replica (infer.shard.builder.cpu_views).
  const bool views = alignment == 1 && one_host;
  for (int64_t rank = 0; rank < plan_world_size; ++rank) {
    schema::Document local_tables = schema::Document::array();
    std::vector<ShardKey> local_keys;
    struct LocalFeature {
      size_t feature;
      int64_t out_col, lo;
      size_t local;
      int64_t kind, hi, dim;
    };
    std::vector<LocalFeature> local_features;
    std::vector<std::vector<uint64_t>> groups;  // per shard on the device: its local tables (one, or one per block)
    for (const auto& table : tables) {
      const auto name = table["name"].get<std::string>();
      const auto& entry = *plan_of[name];
      const auto kind = entry["sharding_type"].get<std::string>();
      for (size_t s = 0; s < entry["shards"].size(); ++s) {
        const auto& planned = entry["shards"][s];
        if (planned["device"].get<int64_t>() != rank) continue;
        const bool view = views && (kind == "row_wise" || kind == "table_row_wise" || kind == "column_wise");
        const schema::Document shard =
            view ? schema::Document{{"row_offset", 0},
                                    {"num_rows", table["num_embeddings"]},
                                    {"col_offset", 0},
                                    {"num_cols", table["embedding_dim"]}}
                 : planned;
        const size_t local = groups.size();
        groups.emplace_back();
        auto add = [&](const schema::Document& rows, const schema::Document& type, int64_t block) {
          groups.back().push_back(local_tables.size());
          local_tables.push_back({{"rows", rows}, {"dim", shard["num_cols"]}, {"data_type", type}});
          local_keys.emplace_back(static_cast<int64_t>(table_index[name]), shard["row_offset"].get<int64_t>(),
                                  shard["col_offset"].get<int64_t>(), shard["num_rows"].get<int64_t>(),
                                  shard["num_cols"].get<int64_t>(), block);
        };
        // a table in precision blocks (table-wise, above): a kernel table per block
        if (table.contains("blocks"))
          for (size_t j = 0; j < table["blocks"].size(); ++j)
            add(table["blocks"][j]["rows"], table["blocks"][j]["data_type"], static_cast<int64_t>(j));
        else
          add(shard["num_rows"], table["data_type"], -1);
        for (size_t f = 0; f < features.size(); ++f) {
          if (features[f]["table"] != name) continue;
          int64_t read = 0, lo = 0, hi = 0;
          if (view || kind == "replicated") {
            read = 2;
            lo = static_cast<int64_t>(s);
            hi = static_cast<int64_t>(entry["shards"].size());
          } else if (kind == "row_wise" || kind == "table_row_wise") {
            read = 1;
            lo = shard["row_offset"].get<int64_t>();
            hi = lo + shard["num_rows"].get<int64_t>();
          }
          const int64_t out_col = features[f]["column_start"].get<int64_t>() + shard["col_offset"].get<int64_t>();
          local_features.push_back({f, out_col, lo, local, read, hi, shard["num_cols"].get<int64_t>()});
        }
      }
    }
    if (local_tables.empty()) continue;
    kernel_ranks.push_back(rank);
    std::stable_sort(local_features.begin(), local_features.end(), [](const LocalFeature& a, const LocalFeature& b) {
      return std::tie(a.feature, a.out_col, a.lo) < std::tie(b.feature, b.out_col, b.lo);
    });
    // every feature read once per level of blocks, level-major: level 0 at its table's cold (last) block, level
    // k >= 1 at its (k-1)-th block or, past its blocks, its cold block (infer.modules.collection.level_blocks)
    schema::Document feature_table_map = schema::Document::array();
    size_t levels = 1;
    for (const auto& lf : local_features) levels = std::max(levels, groups[lf.local].size());
    for (size_t k = 0; k < levels; ++k)
      for (const auto& lf : local_features) {
        const auto& blocks = groups[lf.local];
        feature_table_map.push_back(blocks[k == 0 || k >= blocks.size() ? blocks.size() - 1 : k - 1]);
      }
    Routing device_routing;
    for (const auto& lf : local_features)
      device_routing.push_back({static_cast<int64_t>(lf.feature), lf.kind, lf.lo, lf.hi, lf.out_col, lf.dim});
    routing.push_back(std::move(device_routing));
    expected.push_back({{"row_alignment", alignment}, {"tables", local_tables}, {"feature_table_map", feature_table_map}});
    shard_keys.push_back(std::move(local_keys));
  }
  // On one CPU host, every distinct shard stored once in one buffer shared by the kernels, when some
  // repeat (replicas, row- and column-wise views): infer.shard.builder.shared_cpu_storage.
  if (views) {
    std::map<ShardKey, int64_t> placed;  // each distinct shard once, in table, row, column order: first its bytes
    size_t local_count = 0;
    for (size_t k = 0; k < expected.size(); ++k)
      for (size_t t = 0; t < shard_keys[k].size(); ++t, ++local_count)
        placed.emplace(shard_keys[k][t], table_bytes(expected[k]["tables"][t], alignment));
    if (placed.size() != local_count) {
      int64_t cursor = 0;
      for (auto& entry : placed) {  // then its first byte in the shared buffer
        const int64_t size = entry.second;
        entry.second = cursor;
        cursor += size;
      }
      for (size_t k = 0; k < expected.size(); ++k) {
        std::vector<int64_t> offsets;
        for (const auto& key : shard_keys[k]) offsets.push_back(placed[key]);
        expected[k]["shared_storage"] = {{"bytes", cursor}, {"table_offsets", offsets}};
      }
    }
  }
  // Version 3: every CPU weight buffer in its own file, tables page-aligned (infer.artifact.mapped.place_weights;
  // a multi-host artifact places each host's kernels in files of its part, hosts/<h>/: place_host_weights).
  if (is_mapped(data) && alignment == 1) {
    if (!data.contains("hosts")) {
      std::vector<size_t> all(expected.size());
      for (size_t k = 0; k < all.size(); ++k) all[k] = k;
      place_weights(expected, all, "");
    } else {
      const int64_t per_host = topology.contains("local_world_size") ? topology["local_world_size"].get<int64_t>()
                                                                     : plan_world_size;
      for (int64_t host = 0; host < data["hosts"]["count"].get<int64_t>(); ++host) {
        std::vector<size_t> own;
        for (size_t k = 0; k < expected.size(); ++k)
          if (kernel_ranks[k] / std::max<int64_t>(1, per_host) == host) own.push_back(k);
        place_weights(expected, own, "hosts/" + std::to_string(host) + "/");
      }
    }
  }
  const auto& kernels = data["kernels"];
  bool same = kernels.size() == expected.size();
  for (size_t k = 0; same && k < kernels.size(); ++k)
    same = kernels[k]["row_alignment"] == expected[k]["row_alignment"] && kernels[k]["tables"] == expected[k]["tables"] &&
           kernels[k]["feature_table_map"] == expected[k]["feature_table_map"] &&
           storage_of(kernels[k]) == storage_of(expected[k]);
  if (!same) fail("the manifest's 'kernels' disagree with the plan (the shards each device holds)");
  return routing;
}

// dlopen'ed libraries stay loaded for the life of the process; loading is serialised.
std::mutex& library_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::vector<std::string> load_libraries(const std::vector<std::string>& names, const std::vector<std::string>& dirs) {
  std::lock_guard<std::mutex> lock(library_mutex());
  std::vector<std::string> loaded;
  for (const auto& name : names) {
    if (name.empty() || fs::path(name).filename().string() != name)
      throw LibraryError("manifest.json lists an fbgemm library that is not a plain file name: '" + name + "'");
    std::string found;
    for (const auto& dir : dirs) {
      std::error_code ec;
      if (fs::is_regular_file(fs::path(dir) / name, ec)) {
        found = fs::absolute(fs::path(dir) / name).string();
        break;
      }
    }
    if (found.empty()) {
      std::ostringstream searched;
      for (size_t i = 0; i < dirs.size(); ++i) searched << (i ? ", " : "") << dirs[i];
      throw LibraryError("fbgemm library " + name + " not found; searched: [" + searched.str() +
                         "] (LoadOptions.library_dirs, $EMBSERVE_FBGEMM_LIB_DIR, the manifest's fbgemm.build_dir, "
                         "the fbgemm_gpu folder embserve_loader was built with)");
    }
    if (dlopen(found.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* reason = dlerror();
      throw LibraryError("cannot load fbgemm library " + found + ": " + (reason ? reason : "unknown dlopen error"));
    }
    loaded.push_back(found);
  }
  return loaded;
}

// Turn an error from the TorchScript interpreter into a typed one.
[[noreturn]] void rethrow_script_error(const std::exception& err) {
  std::string text = message_of(err);
  auto at = text.rfind(kRequestPrefix);
  if (at != std::string::npos) throw RequestError(first_line(text.substr(at + std::string(kRequestPrefix).size())));
  throw ModelError("the model failed: " + text);
}

// The TBE's view of the world must be the one the manifest's kernels describe, checked before the
// first lookup: a tampered-but-rehashed model.pt fails here as a ModelError instead of crashing in the
// kernel. Codes and layout as fbgemm 1.8.0's IntNBitTableBatchedEmbeddingBagsCodegen.
class KernelCheck {
 public:
  KernelCheck(const torch::jit::Module& tbe, std::string where) : tbe_(tbe), where_(std::move(where)) {}

  [[noreturn]] void fail(const std::string& message) const { throw ModelError(where_ + ": " + message); }

  c10::IValue attr(const std::string& name) const {
    if (!tbe_.hasattr(name)) fail("the kernel has no attribute '" + name + "'");
    return tbe_.attr(name);
  }

  // A tensor attribute of the expected dtype and, when given, 1-D with `length` entries; CPU, contiguous.
  at::Tensor tensor(const std::string& name, at::ScalarType dtype, std::optional<int64_t> length) const {
    c10::IValue value = attr(name);
    if (!value.isTensor()) fail(name + " is not a tensor (" + value.tagKind() + ")");
    at::Tensor found = value.toTensor();
    if (found.scalar_type() != dtype)
      fail(name + " has dtype " + std::string(c10::toString(found.scalar_type())) + ", expected " +
           std::string(c10::toString(dtype)));
    if (length.has_value() && (found.dim() != 1 || found.size(0) != *length)) {
      std::ostringstream shape;
      shape << found.sizes();
      fail(name + " has shape " + shape.str() + ", expected [" + std::to_string(*length) + "]");
    }
    return found.to(at::kCPU).contiguous();
  }

  int64_t integer(const std::string& name) const {
    c10::IValue value = attr(name);
    if (!value.isInt()) fail(name + " is not an int (" + value.tagKind() + ")");
    return value.toInt();
  }

  void expect_int(const std::string& name, int64_t expected) const {
    const int64_t found = integer(name);
    if (found != expected)
      fail(name + " is " + std::to_string(found) + " but the manifest's kernel implies " + std::to_string(expected));
  }

 private:
  const torch::jit::Module& tbe_;
  std::string where_;
};

// What a manifest kernel implies, as the rules of kernel_attributes.json name it (infer/artifact/kernel_attributes.py
// implements the same rules).
struct KernelFacts {
  std::vector<int64_t> type_codes, rows, table_offsets;  // per feature (feature_table_map entry)
  std::vector<int64_t> dim_offsets{0};                   // 0, then each feature's table dim summed
  std::map<std::string, int64_t> max_dim;                // per data type, over the kernel's tables
  int64_t weight_bytes = 0, alignment = 1;
  bool on_cpu = true;
  std::string device;
};

// The list of kernel attributes (infer/artifact/kernel_attributes.json, embedded at build time), parsed once.
const json& kernel_attributes() {
  static const json parsed = json::parse(kKernelAttributesJson);
  return parsed;
}

// A length rule: how many entries a 1-D tensor attribute holds; nullopt for "empty" (no element, any shape).
std::optional<int64_t> length_rule(const std::string& rule, const KernelFacts& k, const KernelCheck& check) {
  const auto features = static_cast<int64_t>(k.type_codes.size());
  if (rule == "features") return features;
  if (rule == "features+1") return features + 1;
  if (rule == "host_weight_bytes") return k.on_cpu ? k.weight_bytes : 0;
  if (rule == "device_weight_bytes") return k.on_cpu ? 0 : k.weight_bytes;
  if (rule == "one") return 1;
  if (rule == "empty") return std::nullopt;
  check.fail("kernel_attributes.json names the length rule '" + rule + "', which this loader does not implement");
}

// A value rule: the expected value (an array of one per entry for a tensor), or {"one_of": [...]} / {"at_least": n}.
json value_rule(const std::string& rule, const json& arg, const KernelFacts& k, const KernelCheck& check) {
  if (rule == "type_codes") return k.type_codes;
  if (rule == "rows") return k.rows;
  if (rule == "dim_offsets") return k.dim_offsets;
  if (rule == "table_offsets") return k.table_offsets;
  if (rule == "placement") return std::vector<int64_t>(k.type_codes.size(), k.on_cpu ? 3 : 0);  // HOST / DEVICE
  if (rule == "zeros") return json{{"one_of", json::array({0})}};
  if (rule == "host_weight_bytes") return k.on_cpu ? k.weight_bytes : 0;
  if (rule == "row_alignment") return k.alignment;
  if (rule == "total_dim") return k.dim_offsets.back();
  if (rule == "max_dim") {
    const auto found = k.max_dim.find(arg.get<std::string>());
    return found == k.max_dim.end() ? 0 : found->second;
  }
  if (rule == "feature_count") return static_cast<int64_t>(k.type_codes.size());
  if (rule == "device") return k.device;
  if (rule == "constant") return arg;
  if (rule == "one_of") return json{{"one_of", arg}};
  if (rule == "positive") return json{{"at_least", 1}};
  if (rule == "empty") return nullptr;
  check.fail("kernel_attributes.json names the value rule '" + rule + "', which this loader does not implement");
}

bool accepts(const json& expected, const json& found) {
  if (expected.is_object() && expected.contains("one_of"))
    return std::find(expected["one_of"].begin(), expected["one_of"].end(), found) != expected["one_of"].end();
  if (expected.is_object() && expected.contains("at_least"))
    return found.is_number_integer() && found.get<int64_t>() >= expected["at_least"].get<int64_t>();
  return found == expected;
}

std::string wanted(const json& expected) {
  if (expected.is_object() && expected.contains("one_of")) return "must be one of " + expected["one_of"].dump();
  if (expected.is_object() && expected.contains("at_least")) return "must be at least " + expected["at_least"].dump();
  return "the manifest's kernel implies " + expected.dump();
}

// fbgemm's script objects are checked through their own methods (TensorQueue.size/top, AtomicCounter.get).
c10::IValue call(const c10::IValue& value, const std::string& method, const std::string& name, const std::string& what,
                 const KernelCheck& check) {
  if (!value.isObject()) check.fail(name + " is not fbgemm's " + what + " (" + value.tagKind() + ")");
  torch::jit::Object object(value.toObject());
  if (!object.find_method(method).has_value()) check.fail(name + " is not fbgemm's " + what);
  return object.run_method(method);
}

// One entry of the list against the module `check` looks at.
void check_listed(const KernelCheck& check, const json& attribute, const KernelFacts& k) {
  const auto name = attribute["name"].get<std::string>();
  const auto kind = attribute["kind"].get<std::string>();
  const json arg = attribute.contains("arg") ? attribute["arg"] : json();
  const json expected = attribute.contains("value") ? value_rule(attribute["value"], arg, k, check) : json();
  auto expect = [&](const json& found, const json& want, const std::string& label) {
    if (!accepts(want, found)) check.fail(label + " is " + found.dump() + " but " + wanted(want));
  };
  if (kind == "tensor") {
    static const std::map<std::string, at::ScalarType> dtypes = {
        {"uint8", at::kByte}, {"int32", at::kInt}, {"int64", at::kLong}};
    const auto length = length_rule(attribute["length"].get<std::string>(), k, check);
    const at::Tensor found = check.tensor(name, dtypes.at(attribute["dtype"].get<std::string>()), length);
    if (!length.has_value()) {
      std::ostringstream shape;
      shape << found.sizes();
      if (found.numel() != 0) check.fail(name + " must be empty, it has shape " + shape.str());
      return;
    }
    if (expected.is_null()) return;
    const at::Tensor values = found.to(at::kLong);  // dtype and shape checked first: values are read only after
    const int64_t* data = values.data_ptr<int64_t>();
    for (int64_t i = 0; i < *length; ++i)
      expect(json(data[i]), expected.is_array() ? expected[static_cast<size_t>(i)] : expected,
             name + "[" + std::to_string(i) + "]");
    return;
  }
  const c10::IValue value = check.attr(name);
  if (kind == "int") {
    if (!value.isInt()) check.fail(name + " is not an int (" + value.tagKind() + ")");
    expect(json(value.toInt()), expected, name);
  } else if (kind == "bool") {
    if (!value.isBool()) check.fail(name + " is not a bool (" + value.tagKind() + ")");
    expect(json(value.toBool()), expected, name);
  } else if (kind == "str") {
    if (!value.isString()) check.fail(name + " is not a str (" + value.tagKind() + ")");
    expect(json(value.toStringRef()), expected, name);
  } else if (kind == "tensor_queue") {  // its pop() of an empty queue is the initial tensor the kernel reads
    const c10::IValue size = call(value, "size", name, "TensorQueue", check);
    const c10::IValue top = call(value, "top", name, "TensorQueue", check);
    if (!size.isInt() || size.toInt() != 0 || !top.isTensor() || top.toTensor().numel() != 0)
      check.fail(name + " must be an empty queue of empty tensors (no cache)");
  } else if (kind == "counter") {
    const c10::IValue count = call(value, "get", name, "AtomicCounter", check);
    if (!count.isInt()) check.fail(name + " is not fbgemm's AtomicCounter");
    expect(json(count.toInt()), expected, name);
  } else {
    check.fail("kernel_attributes.json names the kind '" + kind + "', which this loader does not implement");
  }
}

void check_kernel(const torch::jit::Module& tbe, const schema::Document& kernel, const std::string& where) {
  KernelCheck check(tbe, where);
  const auto& tables = kernel["tables"];
  const auto ftm = kernel["feature_table_map"].get<std::vector<size_t>>();
  KernelFacts facts;
  facts.alignment = kernel["row_alignment"].get<int64_t>();
  facts.device = kernel["device"].get<std::string>();
  facts.on_cpu = facts.device == "cpu";

  std::vector<int64_t> table_offsets, table_sizes;
  for (const auto& table : tables) {
    const auto type = table["data_type"].get<std::string>();
    table_offsets.push_back(facts.weight_bytes);
    table_sizes.push_back(table_bytes(table, facts.alignment));
    facts.weight_bytes += table_sizes.back();
    facts.max_dim[type] = std::max(facts.max_dim[type], table["dim"].get<int64_t>());
  }
  // CPU replicas point into one shared buffer; a version 3 kernel's buffer lies in its weight file
  const char* storage = kernel.contains("weights") ? "weights" : "shared_storage";
  if (kernel.contains(storage)) {
    table_offsets = kernel[storage]["table_offsets"].get<std::vector<int64_t>>();
    facts.weight_bytes = kernel[storage]["bytes"].get<int64_t>();
    if (table_offsets.size() != tables.size()) check.fail(std::string(storage) + " lists an offset per table");
    for (size_t t = 0; t < tables.size(); ++t)
      if (table_offsets[t] % 128 != 0 || table_offsets[t] + table_sizes[t] > facts.weight_bytes)
        check.fail("table " + std::to_string(t) + " at byte " + std::to_string(table_offsets[t]) +
                   " does not fit the " + std::to_string(facts.weight_bytes) + "-byte weight buffer");
  }
  for (size_t table : ftm) {
    const auto& spec = tables[table];
    facts.type_codes.push_back(data_type_code(spec["data_type"].get<std::string>()));
    facts.rows.push_back(spec["rows"].get<int64_t>());
    facts.dim_offsets.push_back(facts.dim_offsets.back() + spec["dim"].get<int64_t>());
    facts.table_offsets.push_back(table_offsets[table]);
  }
  for (const auto& attribute : kernel_attributes()["tbe"]) check_listed(check, attribute, facts);
}

torch::jit::Module child(const torch::jit::Module& parent, const std::string& name, const std::string& where) {
  if (!parent.hasattr(name) || !parent.attr(name).isModule())
    throw ModelError(where + ": the model has no submodule '" + name + "'");
  return parent.attr(name).toModule();
}

// Every TBE of the model (embeddings.tbe, or embeddings.shards[i].tbe) against manifest kernel i.
// The module around a kernel (the unsharded collection, or one device's shards) runs it batch-parallel
// (infer.modules.tbe.KernelRunner); its attributes steer slicing of the request, so they are checked too.
void check_kernel_holder(torch::jit::Module& holder, const schema::Document& kernel, const std::string& where,
                         int threads) {
  const auto& listed = kernel_attributes()["holder"];
  if (!holder.hasattr(listed["present_if"].get<std::string>())) {
    // exported before this list (precision blocks): its attributes are not the list's; it still splits a batch
    if (threads > 0 && holder.hasattr("threads")) holder.setattr("threads", c10::IValue(static_cast<int64_t>(threads)));
    return;
  }
  KernelCheck check(holder, where);
  KernelFacts facts;
  facts.device = kernel["device"].get<std::string>();
  facts.on_cpu = facts.device == "cpu";
  facts.type_codes.assign(kernel["feature_table_map"].size(), 0);  // the holder's rules need the feature count only
  for (const auto& attribute : listed["attributes"]) check_listed(check, attribute, facts);
  if (threads > 0) holder.setattr("threads", c10::IValue(static_cast<int64_t>(threads)));
}

// A sharded device's routing (DeviceShards: which features it reads, row blocks, replica slices, output
// columns, and what __init__ derives from them) is the plan's: it steers slicing and copies.
void check_routing(torch::jit::Module& holder, const Routing& routing, const schema::Document& features,
                   const std::string& where) {
  KernelCheck check(holder, where);
  auto ints = [&](const std::string& name) {
    const c10::IValue value = check.attr(name);
    if (!value.isIntList()) check.fail("routing " + name + " is not a list of ints");
    return value.toIntVector();
  };
  auto expect = [&](const std::string& name, const std::vector<int64_t>& expected) {
    if (ints(name) != expected) check.fail("routing " + name + " disagrees with the plan");
  };
  static const char* kColumns[] = {"lf_feature", "lf_kind", "lf_lo", "lf_hi", "lf_out_col", "lf_dim"};
  for (size_t c = 0; c < 6; ++c) {
    std::vector<int64_t> expected;
    for (const auto& lf : routing) expected.push_back(lf[c]);
    expect(kColumns[c], expected);
  }
  std::vector<int64_t> local_col, rows, block_entries, block_lo, block_hi, copy_src, copy_dst, copy_width;
  int64_t col = 0, min_rows = 0;
  bool contiguous = true;
  for (size_t i = 0; i < routing.size(); ++i) {
    const auto& [feature, kind, lo, hi, out_col, dim] = routing[i];
    local_col.push_back(col);
    rows.push_back(features[static_cast<size_t>(feature)]["num_embeddings"].get<int64_t>());
    min_rows = i == 0 ? rows.back() : std::min(min_rows, rows.back());
    if (kind == 1) {
      block_entries.push_back(static_cast<int64_t>(i));
      block_lo.push_back(lo);
      block_hi.push_back(hi);
    }
    contiguous = contiguous && kind == 0 && feature == routing[0][0] + static_cast<int64_t>(i);
    if (kind == 0) {
      if (!copy_src.empty() && copy_src.back() + copy_width.back() == col &&
          copy_dst.back() + copy_width.back() == out_col) {
        copy_width.back() += dim;
      } else {
        copy_src.push_back(col);
        copy_dst.push_back(out_col);
        copy_width.push_back(dim);
      }
    }
    col += dim;
  }
  expect("lf_local_col", local_col);
  expect("lf_rows", rows);
  expect("row_block_entries", block_entries);
  expect("row_block_lo", block_lo);
  expect("row_block_hi", block_hi);
  expect("copy_src", copy_src);
  expect("copy_dst", copy_dst);
  expect("copy_width", copy_width);
  check.expect_int("min_rows", min_rows);
  const c10::IValue flag = check.attr("contiguous_input");
  if (!flag.isBool() || flag.toBool() != contiguous) check.fail("routing contiguous_input disagrees with the plan");
}

// The sharded collection bucketizes every row-wise feature for all devices in one fbgemm call when device j's
// row blocks are bucket j (infer.modules.sharded.row_buckets): per feature, the devices' blocks in device order
// tile its rows, an empty bucket for a device without one. `on` is false when a device holds two blocks of one
// feature or the blocks do not tile (each device then bucketizes its own).
struct RowBuckets {
  bool on = false;
  std::vector<int64_t> features;
  std::vector<std::vector<int64_t>> positions;
  std::vector<int64_t> block_sizes;
  bool even = false;
};

RowBuckets row_buckets(const std::vector<Routing>& routing, const schema::Document& features) {
  std::map<int64_t, std::map<size_t, std::pair<int64_t, int64_t>>> blocks;
  for (size_t j = 0; j < routing.size(); ++j)
    for (const auto& lf : routing[j]) {
      if (lf[1] != 1) continue;
      auto& per_device = blocks[lf[0]];
      if (per_device.count(j)) return {};
      per_device[j] = {lf[2], lf[3]};
    }
  RowBuckets buckets;
  if (blocks.empty()) return buckets;
  buckets.even = true;
  for (const auto& [feature, per_device] : blocks) {
    std::vector<int64_t> bounds{0};
    for (size_t j = 0; j < routing.size(); ++j) {
      const auto found = per_device.find(j);
      const auto [lo, hi] = found == per_device.end() ? std::make_pair(bounds.back(), bounds.back()) : found->second;
      if (lo != bounds.back()) return {};
      bounds.push_back(hi);
    }
    if (bounds.back() != features[static_cast<size_t>(feature)]["num_embeddings"].get<int64_t>()) return {};
    int64_t size = 0;
    for (size_t j = 0; j + 1 < bounds.size(); ++j) size = std::max(size, bounds[j + 1] - bounds[j]);
    for (size_t j = 0; j < bounds.size(); ++j)
      buckets.even = buckets.even && bounds[j] == std::min(static_cast<int64_t>(j) * size, bounds.back());
    buckets.features.push_back(feature);
    buckets.positions.push_back(std::move(bounds));
    buckets.block_sizes.push_back(size);
  }
  buckets.on = true;
  return buckets;
}

void check_row_buckets(torch::jit::Module& embeddings, const std::vector<Routing>& routing,
                       const schema::Document& features, const std::string& where) {
  if (!embeddings.hasattr("bucketized")) return;  // exported before one-call bucketing
  KernelCheck check(embeddings, where);
  const RowBuckets buckets = row_buckets(routing, features);
  auto fail = [&](const std::string& name) {
    check.fail("row-wise bucketing " + name + " disagrees with the plan; the model file is corrupted, re-export it");
  };
  auto expect_ints = [&](torch::jit::Module& module, const std::string& name, const std::vector<int64_t>& expected) {
    const c10::IValue value = KernelCheck(module, where).attr(name);
    if (!value.isIntList() || value.toIntVector() != expected) fail(name);
  };
  auto expect_bool = [&](const std::string& name, bool expected) {
    const c10::IValue value = check.attr(name);
    if (!value.isBool() || value.toBool() != expected) fail(name);
  };
  expect_bool("bucketized", buckets.on);
  expect_bool("rw_even_blocks", buckets.on && buckets.even);
  expect_ints(embeddings, "rw_features", buckets.features);
  expect_ints(embeddings, "rw_block_sizes", buckets.block_sizes);
  std::vector<int64_t> rows;
  for (const int64_t f : buckets.features) rows.push_back(features[static_cast<size_t>(f)]["num_embeddings"].get<int64_t>());
  expect_ints(embeddings, "rw_rows", rows);
  if (check.integer("rw_min_rows") != (rows.empty() ? 0 : *std::min_element(rows.begin(), rows.end())))
    fail("rw_min_rows");
  const c10::IValue positions = check.attr("rw_positions");
  if (!positions.isList() || positions.toListRef().size() != buckets.positions.size()) fail("rw_positions");
  for (size_t r = 0; r < buckets.positions.size(); ++r) {
    const c10::IValue entry = positions.toListRef()[r];
    if (!entry.isIntList() || entry.toIntVector() != buckets.positions[r]) fail("rw_positions");
  }
  torch::jit::Module shards = child(embeddings, "shards", where);
  for (size_t j = 0; j < routing.size(); ++j) {
    torch::jit::Module holder = child(shards, std::to_string(j), where);
    std::vector<int64_t> slots;
    bool reads_blocks = false;
    for (const auto& lf : routing[j]) {
      reads_blocks = reads_blocks || lf[1] == 1;
      int64_t slot = -1;
      if (buckets.on && lf[1] == 1)
        slot = std::find(buckets.features.begin(), buckets.features.end(), lf[0]) - buckets.features.begin();
      slots.push_back(slot);
    }
    KernelCheck device(holder, where + " shards." + std::to_string(j));
    if (device.integer("bucket") != (buckets.on && reads_blocks ? static_cast<int64_t>(j) : -1)) fail("bucket");
    if (device.integer("rw_feature_count") != static_cast<int64_t>(buckets.features.size())) fail("rw_feature_count");
    expect_ints(holder, "rw_slot", slots);
  }
}

// How many submodules `module` has (embeddings.shards: one per device that holds shards).
size_t child_count(const torch::jit::Module& module) {
  size_t count = 0;
  for (const auto& unused : module.named_children()) {
    (void)unused;
    ++count;
  }
  return count;
}

// Every TBE of the model (embeddings.tbe, or embeddings.shards[i].tbe) against manifest kernel i; then
// each CPU kernel may split a batch over `threads` example ranges (0: leave the exported setting).
void check_kernels(const torch::jit::Module& model, const schema::Document& data, const std::vector<Routing>& routing,
                   const std::string& model_path, int threads) {
  const auto& kernels = data["kernels"];
  try {
    torch::jit::Module embeddings = child(model, "embeddings", model_path);
    if (embeddings.hasattr("shards")) {
      torch::jit::Module shards = child(embeddings, "shards", model_path);
      const size_t count = child_count(shards);
      if (count != kernels.size())
        throw ModelError(model_path + ": the model has " + std::to_string(count) + " kernels (embeddings.shards) but " +
                         "the manifest lists " + std::to_string(kernels.size()));
      for (size_t i = 0; i < count; ++i) {
        const std::string holder_name = "embeddings.shards." + std::to_string(i);
        const std::string where = model_path + ": kernel " + std::to_string(i) + " (" + holder_name + ".tbe)";
        torch::jit::Module holder = child(shards, std::to_string(i), where);
        check_kernel(child(holder, "tbe", where), kernels[i], where);
        const std::string holder_where = model_path + ": kernel " + std::to_string(i) + " (" + holder_name + ")";
        if (i >= routing.size())
          throw ModelError(holder_where + ": the plan implies " + std::to_string(routing.size()) + " kernels");
        check_routing(holder, routing[i], data["features"], holder_where);
        check_kernel_holder(holder, kernels[i], holder_where, threads);
      }
      check_row_buckets(embeddings, routing, data["features"], model_path + ": embeddings");
    } else {
      if (kernels.size() != 1)
        throw ModelError(model_path + ": the model has one kernel (embeddings.tbe) but the manifest lists " +
                         std::to_string(kernels.size()));
      const std::string where = model_path + ": kernel 0 (embeddings.tbe)";
      check_kernel(child(embeddings, "tbe", where), kernels[0], where);
      check_kernel_holder(embeddings, kernels[0], model_path + ": kernel 0 (embeddings)", threads);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    throw ModelError(model_path + ": the kernels cannot be checked: " + first_line(message_of(err)));
  }
}

// Python's repr of a list of names: ['a', 'b'].
std::string name_list(const std::vector<std::string>& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", '" : "'") + names[i] + "'";
  return out + "]";
}

// A dtype as Python prints it (torch.int32).
std::string torch_dtype(at::ScalarType type) {
  static const std::map<at::ScalarType, std::string> names = {
      {at::kByte, "uint8"},   {at::kChar, "int8"},      {at::kShort, "int16"},   {at::kInt, "int32"},
      {at::kLong, "int64"},   {at::kFloat, "float32"},  {at::kDouble, "float64"}, {at::kHalf, "float16"},
      {at::kBool, "bool"},    {at::kBFloat16, "bfloat16"}};
  const auto found = names.find(type);
  return "torch." + (found == names.end() ? std::string(c10::toString(type)) : found->second);
}

// Why `remap` (one feature's copy of a table's stored id remap: each id's position in the blocks laid end to end,
// infer.modules.collection.encode_remap) is not the manifest's entry, or "" (the checks and words of
// infer.artifact.formats.torchscript.check_block_remaps and collection.remap_error, in their order). The positions
// are a permutation of the rows exactly when the ranks they decode to are.
std::string remap_problem(const at::Tensor& remap, int64_t rows, const std::string& sha256) {
  if (remap.dim() != 1 || remap.is_floating_point() || remap.scalar_type() == at::kBool || remap.numel() != rows) {
    std::ostringstream shape;
    shape << remap.sizes();
    return "is " + torch_dtype(remap.scalar_type()) + " of shape " + shape.str() + ", not " + std::to_string(rows) +
           " integer block rows";
  }
  const at::Tensor held = remap.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t* positions = held.data_ptr<int64_t>();
  std::vector<bool> seen(static_cast<size_t>(rows), false);
  bool outside = false, twice = false;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t position = positions[i];
    if (position < 0 || position >= rows) {
      outside = true;
      continue;
    }
    twice = twice || seen[static_cast<size_t>(position)];
    seen[static_cast<size_t>(position)] = true;
  }
  if (outside) return "names a row outside the table's blocks";
  if (twice) return "gives two ids the same rank";
  if (remap.scalar_type() != at::kInt) return "is " + torch_dtype(remap.scalar_type()) + ", not int32";
  // the manifest's sha256 is of the int32 values little-endian, as this (x86-64 / aarch64) host holds them
  const at::Tensor bytes = remap.to(at::kCPU).contiguous();
  if (files::sha256_hex(bytes.data_ptr(), static_cast<uint64_t>(rows) * sizeof(int32_t)) != sha256)
    return "differs from the one manifest.json lists (its sha256)";
  return "";
}

// One feature as a kernel reads it, for its block split: the table, the rows of the kernel table it reads, and the
// table's blocks (null: a table in one type).
struct BlockRead {
  std::string table;
  int64_t rows;
  const schema::Document* blocks;
};

// What splits a kernel's input by block (infer.modules.collection.BlockSplit.of_features): the block tables in the
// order the features first read them, each block's first rank, per feature its block table's slot (-1: none), its
// range of block_lookup and its blocks' bounds, the levels, whether the op's fixed-size buckets split the same way.
struct BlockSplitFacts {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> rank_starts;
  std::vector<int64_t> feature_remap, offsets{0}, feature_blocks, sizes;
  std::vector<std::vector<int64_t>> bounds;
  size_t levels = 1;
  bool fixed = false;
};

BlockSplitFacts block_split_of(const std::vector<BlockRead>& reads) {
  BlockSplitFacts split;
  std::map<std::string, int64_t> slot_of;
  for (const auto& read : reads) {
    if (read.blocks == nullptr) continue;
    split.levels = std::max(split.levels, read.blocks->size());
    if (slot_of.count(read.table)) continue;
    slot_of[read.table] = static_cast<int64_t>(split.names.size());
    split.names.push_back(read.table);
    split.rank_starts.emplace_back();
    int64_t start = 0;
    for (const auto& block : *read.blocks) {
      split.rank_starts.back().push_back(start);
      start += block["rows"].get<int64_t>();
    }
  }
  for (const auto& read : reads) {
    const int64_t slot = read.blocks == nullptr ? -1 : slot_of[read.table];
    split.feature_remap.push_back(slot);
    split.feature_blocks.push_back(read.blocks == nullptr ? 1 : static_cast<int64_t>(read.blocks->size()));
    split.offsets.push_back(split.offsets.back() + (slot >= 0 ? read.rows : 0));
    // collection.block_bounds: the cold block, each precise block, then empty blocks up to the levels
    const std::vector<int64_t> starts = slot >= 0 ? split.rank_starts[static_cast<size_t>(slot)] : std::vector<int64_t>{0};
    const int64_t cold_rows = read.rows - starts.back();
    std::vector<int64_t> feature_bounds{0, cold_rows};
    for (size_t j = 1; j < starts.size(); ++j) feature_bounds.push_back(cold_rows + starts[j]);
    while (feature_bounds.size() < split.levels + 1) feature_bounds.push_back(read.rows);
    split.bounds.push_back(std::move(feature_bounds));
  }
  // two levels, every precise block no larger than its cold block: the op's fixed-size buckets (the cold rows)
  split.fixed = split.levels == 2;
  for (const auto& feature_bounds : split.bounds) split.fixed = split.fixed && 2 * feature_bounds[1] >= feature_bounds.back();
  for (const auto& feature_bounds : split.bounds) split.sizes.push_back(split.fixed ? feature_bounds[1] : feature_bounds.back());
  return split;
}

// The block tables a kernel holder (the unsharded collection, or one device's shards) holds remaps of.
std::vector<std::string> held_block_tables(const torch::jit::Module& holder, const std::string& model_path) {
  std::vector<std::string> held;
  if (!holder.hasattr("block_table_names")) return held;
  const c10::IValue value = holder.attr("block_table_names");
  if (!value.isList()) throw ModelError(model_path + ": embeddings.block_table_names is not a list of names");
  for (const auto& name : value.toListRef()) {
    if (!name.isString()) throw ModelError(model_path + ": embeddings.block_table_names is not a list of names");
    held.push_back(name.toStringRef());
  }
  if (!held.empty() && !holder.hasattr("block_bounds"))
    throw ModelError(model_path + " holds precision blocks of tables " + name_list(held) + " in the id remap form " +
                     "of an earlier embserve (no block_bounds); re-export the model with this version");
  return held;
}

// One kernel holder's block split is `split` (what its features imply), and the remaps it holds are the manifest's.
void check_holder_blocks(const torch::jit::Module& holder, const BlockSplitFacts& split, const schema::Document& data,
                         const std::string& where, const std::string& model_path) {
  KernelCheck check(holder, where);
  auto corrupted = [&](const std::string& name) {
    check.fail("the block split's " + name + " disagrees with the manifest's tables; the model file is corrupted, " +
               "re-export it");
  };
  auto expect_ints = [&](const std::string& name, const std::vector<int64_t>& expected) {
    const c10::IValue value = check.attr(name);
    if (!value.isIntList() || value.toIntVector() != expected) corrupted(name);
  };
  auto expect_tensor = [&](const c10::IValue& value, at::ScalarType dtype, const std::vector<int64_t>& expected,
                           const std::string& name) {
    if (!value.isTensor()) corrupted(name);
    const at::Tensor found = value.toTensor();
    if (found.scalar_type() != dtype || found.dim() != 1 || found.numel() != static_cast<int64_t>(expected.size()))
      corrupted(name);
    const at::Tensor values = found.to(at::kCPU).to(at::kLong).contiguous();
    if (!std::equal(expected.begin(), expected.end(), values.data_ptr<int64_t>())) corrupted(name);
  };
  // the ranges first: the remaps are read through them
  expect_ints("feature_remap", split.feature_remap);
  expect_tensor(check.attr("block_lookup_offsets"), at::kLong, split.offsets, "block_lookup_offsets");
  const c10::IValue lookup_value = check.attr("block_lookup");
  if (!lookup_value.isTensor() || lookup_value.toTensor().dim() != 1 ||
      lookup_value.toTensor().numel() != split.offsets.back())
    corrupted("block_lookup");
  const at::Tensor lookup = lookup_value.toTensor();
  const auto& remaps = data["block_remaps"];
  for (size_t slot = 0; slot < split.names.size(); ++slot) {
    const auto& entry = remaps[split.names[slot]];
    const int64_t rows = entry["rows"].get<int64_t>();
    std::string problem = "is missing";
    for (size_t f = 0; f < split.feature_remap.size(); ++f) {  // a table read by several features holds it once per feature
      if (split.feature_remap[f] != static_cast<int64_t>(slot)) continue;
      if (problem == "is missing") problem.clear();
      if (problem.empty()) problem = remap_problem(lookup.slice(0, split.offsets[f], split.offsets[f + 1]), rows,
                                                   entry["sha256"].get<std::string>());
    }
    if (!problem.empty())
      throw ModelError(model_path + ": the id remap of table '" + split.names[slot] + "' " + problem +
                       "; the artifact is corrupted, re-export it");
  }
  // then what splits a request by level (BlockSplitter.init_block_split's attributes)
  const c10::IValue has_blocks = check.attr("has_blocks");
  if (!has_blocks.isBool() || has_blocks.toBool() != !split.names.empty()) corrupted("has_blocks");
  check.expect_int("block_levels", static_cast<int64_t>(split.levels));
  expect_ints("feature_blocks", split.feature_blocks);
  const c10::IValue starts_value = check.attr("block_rank_starts");
  if (!starts_value.isList() || starts_value.toListRef().size() != split.rank_starts.size()) corrupted("block_rank_starts");
  for (size_t slot = 0; slot < split.rank_starts.size(); ++slot) {
    const c10::IValue entry = starts_value.toListRef()[slot];
    if (!entry.isIntList() || entry.toIntVector() != split.rank_starts[slot]) corrupted("block_rank_starts");
  }
  const c10::IValue bounds_value = check.attr("block_bounds");
  if (!bounds_value.isTensorList() || bounds_value.toTensorList().size() != split.bounds.size()) corrupted("block_bounds");
  const auto held_bounds = bounds_value.toTensorVector();
  for (size_t f = 0; f < split.bounds.size(); ++f) expect_tensor(held_bounds[f], at::kInt, split.bounds[f], "block_bounds");
  const c10::IValue fixed_value = check.attr("block_fixed_sizes");
  if (!fixed_value.isBool() || fixed_value.toBool() != split.fixed) corrupted("block_fixed_sizes");
  expect_tensor(check.attr("block_sizes"), at::kInt, split.sizes, "block_sizes");
}

// A model of tables held in precision blocks (infer.modules.collection.QuantizedEmbeddingBagCollection; issue 43),
// before the first lookup: the id remaps it holds are the manifest's block_remaps (rows, int32, the sha256 of their
// bytes), each sending its table's ids one to one onto the blocks' rows (ModelError naming the table, in the words of
// infer.artifact.formats.torchscript.check_block_remaps); and what cuts a request by block (each feature's range of
// block_lookup, the blocks' bounds and sizes, the levels) is what the manifest's tables imply, so a tampered model
// cannot send an id into another block's rows. A sharded model (`routing`: per device the features its kernel
// reads) holds each block table on the one device it is placed on table-wise (infer.shard.builder.device_layouts),
// and every device's split is the one its features imply. The kernels themselves (a table per block) are checked
// by check_kernels.
void check_block_model(const torch::jit::Module& model, const schema::Document& data, const std::vector<Routing>& routing,
                       const std::string& model_path) {
  const auto& tables = data["tables"];
  std::vector<std::string> names;  // the block tables, in table order
  std::map<std::string, size_t> table_index;
  for (size_t t = 0; t < tables.size(); ++t) {
    table_index[tables[t]["name"].get<std::string>()] = t;
    if (tables[t].contains("blocks")) names.push_back(tables[t]["name"].get<std::string>());
  }
  const auto& features = data["features"];
  auto read_of = [&](size_t feature, int64_t rows) {
    const auto table_name = features[feature]["table"].get<std::string>();
    const auto& table = tables[table_index[table_name]];
    return BlockRead{table_name, rows, table.contains("blocks") ? &table["blocks"] : nullptr};
  };
  try {
    torch::jit::Module embeddings = child(model, "embeddings", model_path);
    const bool sharded = embeddings.hasattr("shards");
    std::vector<torch::jit::Module> holders;
    std::vector<std::vector<BlockRead>> reads;  // per holder, the features its kernel reads
    if (sharded) {
      torch::jit::Module shards = child(embeddings, "shards", model_path);
      for (size_t j = 0; j < child_count(shards) && j < routing.size(); ++j) {
        holders.push_back(child(shards, std::to_string(j), model_path));
        reads.emplace_back();
        for (const auto& lf : routing[j]) {  // infer.modules.sharded.kernel_rows: a row block's rows, else the table's
          const size_t feature = static_cast<size_t>(lf[0]);
          reads.back().push_back(read_of(feature, lf[1] == 1 ? lf[3] - lf[2]
                                                              : features[feature]["num_embeddings"].get<int64_t>()));
        }
      }
    } else {
      holders.push_back(embeddings);
      reads.emplace_back();
      for (size_t f = 0; f < features.size(); ++f)
        reads.back().push_back(read_of(f, features[f]["num_embeddings"].get<int64_t>()));
    }
    std::vector<std::string> held;
    bool twice = false;
    for (const auto& holder : holders)
      for (const auto& name : held_block_tables(holder, model_path)) {
        twice = twice || std::find(held.begin(), held.end(), name) != held.end();
        held.push_back(name);
      }
    std::vector<std::string> sorted_held = held, sorted_names = names;
    std::sort(sorted_held.begin(), sorted_held.end());
    std::sort(sorted_names.begin(), sorted_names.end());
    if (twice || sorted_held != sorted_names)
      throw ModelError(model_path + " holds id remaps of tables " + name_list(held) + ", manifest.json lists " +
                       name_list(names) + "; re-export the model");
    for (size_t j = 0; j < holders.size(); ++j) {
      // an unsharded model without block tables, or a device exported before block tables could be sharded: no split
      if (sharded ? !holders[j].hasattr("has_blocks") : names.empty()) continue;
      const std::string where = model_path + (sharded ? ": embeddings.shards." + std::to_string(j) : ": embeddings");
      check_holder_blocks(holders[j], block_split_of(reads[j]), data, where, model_path);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    throw ModelError(model_path + ": the precision blocks cannot be checked: " + first_line(message_of(err)));
  }
}

// Version 3: hands every CPU kernel (embeddings.tbe, or embeddings.shards.<i>.tbe) a view of its weight buffer
// in its file, mapped read-only once per file (replicas view one mapping), before the kernel checks read it
// (infer.artifact.load.attach_mapped_weights). The views keep the mappings alive.
void attach_weights(const torch::jit::Module& model, const schema::Document& data, files::Mappings& mappings,
                    const std::string& model_path) {
  const auto& kernels = data["kernels"];
  try {
    torch::jit::Module embeddings = child(model, "embeddings", model_path);
    std::vector<torch::jit::Module> tbes;
    if (embeddings.hasattr("shards")) {
      torch::jit::Module shards = child(embeddings, "shards", model_path);
      const size_t count = child_count(shards);
      for (size_t i = 0; i < count; ++i)
        tbes.push_back(child(child(shards, std::to_string(i), model_path), "tbe", model_path));
    } else {
      tbes.push_back(child(embeddings, "tbe", model_path));
    }
    if (tbes.size() != kernels.size())
      throw ModelError(model_path + ": the model has " + std::to_string(tbes.size()) + " kernels, the manifest lists " +
                       std::to_string(kernels.size()));
    for (size_t k = 0; k < kernels.size(); ++k) {
      if (!kernels[k].contains("weights")) continue;
      const auto& weights = kernels[k]["weights"];
      const auto name = weights["file"].get<std::string>();
      // the mapping is the kernel's only source: a model file that still carries weights for it (re-saved after a
      // load, rehashed) is refused, not silently overridden (infer.artifact.mapped.check_no_saved_weights)
      const at::Tensor saved = tbes[k].attr("weights_host").toTensor();
      if (const auto carried = saved.numel() * static_cast<int64_t>(saved.element_size()); carried > 0)
        throw ModelError(model_path + " carries " + std::to_string(carried) + " bytes of weights for kernel " +
                         std::to_string(k) + ", but the manifest maps them from " + name +
                         "; re-export the artifact (embserve export / infer.export)");
      const auto mapping = mappings.get(name, data["files"][name]["bytes"].get<uint64_t>());
      tbes[k].setattr("weights_host", files::mapped_tensor(mapping, weights["offset"].get<int64_t>(),
                                                           weights["bytes"].get<int64_t>()));
    }
    // the scripted model refuses to run until its weights are attached (a bare torch::jit::load of a mapped
    // model.pt would otherwise read empty weight buffers)
    torch::jit::Module top = model;  // a handle to the same module
    if (top.hasattr("weights_attached")) top.setattr("weights_attached", true);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    throw ModelError(model_path + ": the kernels cannot be given their mapped weights: " + first_line(message_of(err)));
  }
}

// The program's inputs, in order, as the manifest's pt2.inputs lists them (infer's pt2 export writes these).
const std::vector<std::string> kPt2Inputs = {"values:int64", "lengths:int64", "weights:float32"};

// "2.13.0+cpu" -> {2, 13, 0}; nullopt when it does not start with three dot-separated numbers.
std::optional<std::array<int, 3>> release_of(const std::string& version) {
  std::array<int, 3> parts{};
  size_t at = 0;
  for (int i = 0; i < 3; ++i) {
    size_t end = at;
    while (end < version.size() && std::isdigit(static_cast<unsigned char>(version[end]))) ++end;
    if (end == at || end - at > 6) return std::nullopt;
    parts[static_cast<size_t>(i)] = std::stoi(version.substr(at, end - at));
    if (i < 2) {
      if (end >= version.size() || version[end] != '.') return std::nullopt;
      at = end + 1;
    } else if (end < version.size() && version[end] != '+' && version[end] != 'a' && version[end] != 'b' &&
               version[end] != 'r' && version[end] != '.' && version[end] != 'd') {
      return std::nullopt;
    }
  }
  return parts;
}

std::string runtime_torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

// An AOTInductor package runs only under the torch release that compiled it (its .so calls libtorch's
// shim ABI of that release): compare major.minor.patch, ignoring the local tag (+cpu, +cu128).
void check_pt2_torch_version(const std::string& compiled, const std::string& pt2_path) {
  const auto release = release_of(compiled);
  const std::array<int, 3> runtime{TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH};
  if (!release.has_value())
    throw ModelError(pt2_path + ": the manifest's pt2.torch_version '" + compiled.substr(0, 64) +
                     "' is not a torch version (major.minor.patch); re-export with `embserve export --pt2`");
  if (*release != runtime)
    throw ModelError(pt2_path + " was compiled by torch " + compiled + " but this loader runs libtorch " +
                     runtime_torch_version() + "; an AOTInductor package loads only under the torch release that "
                     "compiled it: re-export with `embserve export --pt2` under torch " + runtime_torch_version() +
                     ", or load with the TorchScript backend");
}

// Bounded, one line: AOTInductor's errors can carry long generated-code context.
std::string cause_of(const std::exception& err) {
  std::string text = first_line(message_of(err));
  if (text.size() > 512) text = text.substr(0, 512) + "...";
  return text;
}

// The lookup program's metadata entry: per kernel (manifest order, comma-separated) `<constant>=<bytes>`, the
// constant that takes the kernel's mapped weight buffer and the size the program was compiled for; absent when
// model.pt2 carries its tables itself (infer.artifact.formats.pt2_program.WEIGHT_CONSTANTS_KEY).
constexpr const char* kWeightConstantsKey = "embserve.weight_constants";
// The constant a program over mapped weights checks before anything runs: zeros in the package, ones from the
// loaders with the weights; without them the program throws, telling a bare caller to load through embserve
// (infer.artifact.formats.pt2_program.TABLES_ATTACHED, TABLES_ATTACHED_ENTRIES). Absent from older packages.
constexpr const char* kTablesAttached = "tables_attached";
constexpr int64_t kTablesAttachedEntries = 16;

std::vector<std::pair<std::string, int64_t>> read_weight_constants(const std::string& entry,
                                                                   const std::string& pt2_path) {
  std::vector<std::pair<std::string, int64_t>> wanted;
  std::stringstream items(entry);
  std::string item;
  while (std::getline(items, item, ',')) {
    const auto equals = item.rfind('=');
    // a name, '=', then 1 to 18 digits (a byte count that fits int64)
    const bool sized = equals != std::string::npos && equals > 0 && equals + 1 < item.size() &&
                       equals + 19 > item.size() &&
                       item.find_first_not_of("0123456789", equals + 1) == std::string::npos;
    if (!sized)
      throw ModelError(pt2_path + ": malformed " + kWeightConstantsKey + " entry '" + item.substr(0, 80) +
                       "'; re-export the artifact with `embserve export --pt2`");
    wanted.emplace_back(item.substr(0, equals), std::stoll(item.substr(equals + 1)));
  }
  return wanted;
}

// The lookup program's metadata entry of a model with tables in precision blocks: per block table (table order,
// comma-separated) `<table>=<sha256>` of the id remap compiled into the program; absent without blocks
// (infer.artifact.formats.pt2_program.BLOCK_REMAPS_KEY).
constexpr const char* kBlockRemapsKey = "embserve.block_remaps";

// The id remaps compiled into model.pt2 are the manifest's block_remaps, table for table (their sha256); else a
// ModelError naming the first table that differs and the fix (infer.artifact.formats.pt2_runtime.check_block_remaps,
// same words). A changed byte inside model.pt2 is its checksum's to catch.
void check_pt2_block_remaps(torch::inductor::AOTIModelPackageLoader& program, const schema::Document& data,
                            const std::string& pt2_path) {
  const auto metadata = program.get_metadata();
  const auto found = metadata.find(kBlockRemapsKey);
  std::map<std::string, std::string> compiled, listed;
  std::stringstream items(found != metadata.end() ? found->second : "");
  std::string item;
  while (std::getline(items, item, ',')) {
    const auto equals = item.rfind('=');
    if (equals == std::string::npos || equals == 0 || item.size() - equals - 1 != 64)
      throw ModelError(pt2_path + ": malformed " + kBlockRemapsKey + " entry '" + item.substr(0, 80) +
                       "'; re-export the artifact with --pt2");
    compiled[item.substr(0, equals)] = item.substr(equals + 1);
  }
  if (data.contains("block_remaps"))
    for (const auto& remap : data["block_remaps"].items())
      listed[remap.key()] = remap.value()["sha256"].get<std::string>();
  std::set<std::string> tables;
  for (const auto& [name, digest] : compiled) tables.insert(name);
  for (const auto& [name, digest] : listed) tables.insert(name);
  for (const auto& table : tables) {
    const auto held = compiled.find(table), says = listed.find(table);
    if (held != compiled.end() && says != listed.end() && held->second == says->second) continue;
    throw ModelError(pt2_path + " was compiled with " +
                     (held == compiled.end() ? std::string("no remap") : "remap sha256 " + held->second.substr(0, 16) + "...") +
                     " for table '" + table + "', and manifest.json's block_remaps says " +
                     (says == listed.end() ? std::string("no remap") : "sha256 " + says->second.substr(0, 16) + "...") +
                     ": model.pt2 and the manifest come from different exports. Re-export the artifact with --pt2");
  }
}

// A mapped artifact's model.pt2 holds no tables: hand the lookup program every kernel's view of its mapped weight
// file as a user-managed constant (infer.artifact.formats.pt2_runtime.attach_weight_constants), and ones for its
// tables_attached check, after the artifact is verified. AOTInductor (libtorch 2.13) keeps a tensor handle of each user-managed constant that it
// never frees, so it gets a view that does not own the mapping; the returned mappings must outlive the program.
// Then checks that the program's constants are the mapped bytes themselves (no copy).
std::vector<std::shared_ptr<void>> attach_pt2_weights(torch::inductor::AOTIModelPackageLoader& program,
                                                      const schema::Document& data, files::Mappings& mappings,
                                                      const std::string& pt2_path) {
  const auto metadata = program.get_metadata();
  const auto found = metadata.find(kWeightConstantsKey);
  const bool wants = found != metadata.end() && !found->second.empty();
  const auto& entry = data["pt2"];
  const std::string tables = entry.contains("tables") ? entry["tables"].get<std::string>() : "package";
  if (wants != (tables == "weight_files"))
    throw ModelError(pt2_path + (wants ? " takes its tables from the weight files" : " carries its tables itself") +
                     ", but the manifest's pt2.tables says '" + tables + "': model.pt2 and the manifest come from " +
                     "different exports. Re-export the artifact with `embserve export --pt2`");
  if (!wants) return {};
  const auto wanted = read_weight_constants(found->second, pt2_path);
  const auto& kernels = data["kernels"];
  const auto fqns = program.get_constant_fqns();
  bool agree = wanted.size() == kernels.size();
  for (size_t k = 0; agree && k < kernels.size(); ++k)
    agree = kernels[k].contains("weights") && kernels[k]["weights"]["bytes"].get<int64_t>() == wanted[k].second &&
            std::find(fqns.begin(), fqns.end(), wanted[k].first) != fqns.end();
  if (!agree)
    throw ModelError(pt2_path + " was compiled for mapped weight buffers the manifest does not map (model.pt2 and " +
                     "the manifest come from different exports); re-export the artifact with `embserve export --pt2`");
  std::unordered_map<std::string, at::Tensor> constants;
  std::map<std::string, const void*> first_bytes;  // by constant: where its mapped buffer starts
  std::vector<std::shared_ptr<void>> held;
  for (size_t k = 0; k < kernels.size(); ++k) {
    const auto& weights = kernels[k]["weights"];
    const auto name = weights["file"].get<std::string>();
    const auto mapping = mappings.get(name, data["files"][name]["bytes"].get<uint64_t>());
    const at::Tensor view = files::mapped_tensor(mapping, weights["offset"].get<int64_t>(), wanted[k].second);
    constants.emplace(wanted[k].first, at::from_blob(view.data_ptr(), {view.numel()}, view.options()));
    first_bytes.emplace(wanted[k].first, view.data_ptr());
    held.push_back(mapping);
  }
  // AOTInductor keeps a handle of each user-managed constant, which keeps this small tensor alive
  if (std::find(fqns.begin(), fqns.end(), kTablesAttached) != fqns.end())
    constants.emplace(kTablesAttached, at::ones({kTablesAttachedEntries}, at::kLong));
  try {
    program.load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/false, /*user_managed=*/true);
  } catch (const std::exception& err) {
    throw ModelError(pt2_path + " does not take the mapped weights: " + cause_of(err) +
                     "; re-export the artifact with `embserve export --pt2`");
  }
  // extract_constants_map keys constants by their original FQN (the name load_constants takes)
  size_t reading = 0;  // constants whose data is the mapped buffer itself
  for (const auto& [fqn, tensor] : program.get_runner()->extract_constants_map(/*use_inactive=*/false)) {
    const auto expected = first_bytes.find(fqn);
    if (expected != first_bytes.end() && tensor.data_ptr() == expected->second) ++reading;
  }
  if (reading != first_bytes.size())
    throw ModelError(pt2_path + ": AOTInductor holds " + std::to_string(reading) + " of the " +
                     std::to_string(first_bytes.size()) + " mapped weight buffers as given (it copied the others; " +
                     "this libtorch's user-managed constants differ from 2.13's); load with the TorchScript backend");
  return held;
}
}  // namespace

namespace {
double seconds_since(std::chrono::steady_clock::time_point started) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

// How a multi-host artifact is served (infer.artifact.hosts.whole_load_refused says the same to Python's load).
std::string multi_host_serving(const fs::path& root, const std::string& count) {
  return "Serve it on " + count + " hosts with `torchrun --nnodes " + count +
         " --nproc-per-node 1 --rdzv-endpoint HOST0:PORT -m infer.cli serve " + root.string() +
         "` (the same command on every host), or export a one-host artifact for the C++ loader (embserve export "
         "with a one-host plan)";
}

// A multi-host artifact (infer/artifact/hosts.py) is one manifest and one part per host, hosts/<h>/ (model.pt and
// weight files): each part holds only its host's shards, whose partial outputs the hosts exchange
// (server/distributed.py), so no single process serves one. The C++ loader serves one-host artifacts: it refuses
// the artifact's folder (ModelError, as Python's load) and a part's folder (ManifestError: it has no manifest of its
// own), saying how to serve them.
void refuse_multi_host(const fs::path& folder, const schema::Document* data) {
  fs::path named = folder.lexically_normal();
  if (named.filename().empty()) named = named.parent_path();
  if (data != nullptr) {
    if (!data->contains("hosts")) return;
    const auto& hosts = (*data)["hosts"];
    throw ModelError(  // Python's load: ArtifactError(kind=MODEL), the artifact is sound but not for one process
        (folder / "manifest.json").string() + ": " + named.string() + " is a multi-host artifact (" +
        std::to_string(hosts["count"].get<int64_t>()) + " hosts x " +
        std::to_string(hosts["devices_per_host"].get<int64_t>()) + " devices): its model_file " +
        (*data)["model_file"].get<std::string>() +
        " is host 0's part, and each part under hosts/<h>/ holds one host's shards only; the C++ loader serves "
        "one-host artifacts. " + multi_host_serving(named, std::to_string(hosts["count"].get<int64_t>())));
  }
  const fs::path parent = named.parent_path();
  std::error_code ec;
  const std::string host = named.filename().string();
  if (parent.filename() != "hosts" || host.empty() ||
      host.find_first_not_of("0123456789") != std::string::npos ||
      !fs::is_regular_file(parent.parent_path() / "manifest.json", ec))
    return;
  std::string count = "H";  // the artifact's host count, when its manifest says it
  try {
    const auto root = read_document(parent.parent_path() / "manifest.json", "manifest");
    if (!root.contains("hosts")) return;  // a one-host artifact up there: this folder is not one of its parts
    count = std::to_string(root["hosts"]["count"].get<int64_t>());
  } catch (const std::exception&) {  // a broken manifest up there: the refusal still says what this folder is
  }
  throw ManifestError((folder / "manifest.json").string() + " is missing: " + named.string() + " is host " + host +
                      "'s part of the multi-host artifact " + parent.parent_path().string() +
                      ", which holds that host's shards only; the C++ loader serves one-host artifacts. " +
                      multi_host_serving(parent.parent_path(), count));
}

schema::Document read_checked_manifest(const fs::path& folder) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec))
    throw ManifestError(folder.string() + " is not a folder; pass the artifact folder written by export");
  const fs::path manifest_path = folder / "manifest.json";
  if (!fs::exists(manifest_path, ec)) refuse_multi_host(folder, nullptr);
  schema::Document data = read_document(manifest_path, "manifest");
  check_manifest(data, manifest_path.string());  // from here on every key exists with its type and range
  return data;
}

std::vector<Routing> read_checked_plan(const fs::path& folder, const schema::Document& data) {
  if (data["sharding"]["plan_file"].is_null()) return {};
  const fs::path plan_path = folder / data["sharding"]["plan_file"].get<std::string>();
  return check_plan(read_document(plan_path, "plan"), data, plan_path.string());
}
// The one kernel of an unsharded CPU model (the layout the hot-row cache and the prefetcher read rows of), or none.
std::optional<torch::jit::Module> single_cpu_kernel(const torch::jit::Module& model, const std::string& where) {
  torch::jit::Module embeddings = child(model, "embeddings", where);
  if (embeddings.hasattr("shards") || !embeddings.hasattr("tbe") ||
      (embeddings.hasattr("kernel_device") && embeddings.attr("kernel_device").toStringRef() != "cpu"))
    return std::nullopt;
  return child(embeddings, "tbe", where);
}

// prefetch_wanted's auto rule: a shard of the plan in the paged tier.
bool plan_has_paged_tier(const fs::path& folder, const schema::Document& data) {
  if (data["sharding"]["plan_file"].is_null()) return false;
  const schema::Document plan = read_document(folder / data["sharding"]["plan_file"].get<std::string>(), "plan");
  for (const auto& table : plan["tables"])
    for (const auto& shard : table["shards"])
      if (shard.contains("tier") && shard["tier"] == "paged") return true;
  return false;
}

}  // namespace

void check_manifest(const std::string& artifact_dir) {
  const fs::path folder(artifact_dir);
  read_checked_plan(folder, read_checked_manifest(folder));
}

Model Model::load(const std::string& artifact_dir, const LoadOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const fs::path folder(artifact_dir);
  const schema::Document data = read_checked_manifest(folder);
  refuse_multi_host(folder, &data);
  Model model;
  model.path_ = artifact_dir;
  const auto model_file = data["model_file"].get<std::string>();
  model.backend_ = options.backend;
  if (!options.hot_rows.empty() && options.backend != Backend::TorchScript)
    throw ConfigError("hot_rows applies to the torchscript backend, not 'pt2'");
  if (options.backend == Backend::Pt2 && !data.contains("pt2"))
    throw ManifestError((folder / "manifest.json").string() + " has no 'pt2' entry: the artifact carries no " +
                        "model.pt2 for the Pt2 backend. Re-export with `embserve export --pt2` (infer.export(..., " +
                        "pt2=True)), or load with the TorchScript backend");
  for (const auto& f : data["features"]) {
    FeatureInfo info;
    info.name = f["name"].get<std::string>();
    info.table = f["table"].get<std::string>();
    info.num_embeddings = f["num_embeddings"].get<int64_t>();
    info.embedding_dim = f["embedding_dim"].get<int64_t>();
    info.pooling = f["pooling"].get<std::string>();
    info.column_start = f["column_start"].get<int64_t>();
    info.column_end = f["column_end"].get<int64_t>();
    model.output_dim_ = std::max(model.output_dim_, info.column_end);
    model.features_.push_back(std::move(info));
  }
  if (data["dense"]["present"].get<bool>())
    model.num_dense_features_ = data["dense"]["num_dense_features"].get<int64_t>();  // >= 1 (check_manifest)
  const auto libraries = data["fbgemm"]["libraries"].get<std::vector<std::string>>();
  const auto build_dir = data["fbgemm"]["build_dir"].get<std::string>();
  const auto devices = data["devices"].get<std::vector<std::string>>();
  model.world_size_ = static_cast<int>(data["sharding"]["world_size"].get<int64_t>());
  // Every listed file's path and size now (whatever the verify mode: nothing is mapped past a file's end), the
  // sha256 of each file without chunk digests too (plan.json among them, so the plan checked below is the one
  // export wrote); the chunks of large files are hashed by a pool of threads while the model loads.
  const std::vector<files::ListedFile> listed = files::check_listed_files(folder, data["files"], model_file);
  for (const auto& file : listed) model.load_bytes_ += static_cast<int64_t>(file.bytes);
  const bool verify = options.verify == Verify::Full;
  if (verify)
    for (const auto& file : listed)
      if (file.chunk_bytes == 0) files::verify_whole(file);
  files::Mappings mappings(folder);
  std::optional<files::ChunkHashing> hashing;
  if (verify) hashing.emplace(listed, mappings);
  auto verified = [&] {
    if (hashing) hashing->wait();
    hashing.reset();
  };
  const std::vector<Routing> routing = read_checked_plan(folder, data);
  for (const auto& device : devices) {
    if (device.rfind("cuda", 0) == 0 && !torch::cuda::is_available())
      throw ModelError(artifact_dir + " was exported for device " + device +
                       " and this host (or this libtorch) has no CUDA device");
  }

  std::vector<std::string> dirs = options.library_dirs;
  if (const char* env = std::getenv("EMBSERVE_FBGEMM_LIB_DIR"); env && *env) dirs.emplace_back(env);
  if (!build_dir.empty()) dirs.push_back(build_dir);
  if (std::string(EMBSERVE_FBGEMM_DIR).size()) dirs.emplace_back(EMBSERVE_FBGEMM_DIR);
  // before the program: model.pt's types and model.pt2's extern calls both resolve to fbgemm's operators
  const auto libraries_started = std::chrono::steady_clock::now();
  model.libraries_ = load_libraries(libraries, dirs);
  model.library_seconds_ = seconds_since(libraries_started);

  if (options.backend == Backend::Pt2) {
    const auto& pt2 = data["pt2"];
    const fs::path pt2_path = folder / pt2["file"].get<std::string>();
    if (pt2["inputs"].get<std::vector<std::string>>() != kPt2Inputs)
      throw ManifestError((folder / "manifest.json").string() + ": pt2.inputs is " + pt2["inputs"].dump() +
                          "; this loader feeds [values:int64, lengths:int64, weights:float32]. Re-export with " +
                          "`embserve export --pt2`");
    const auto pt2_device = pt2["device"].get<std::string>();
    if (pt2_device != "cpu")
      throw ModelError(pt2_path.string() + " was compiled for device " + pt2_device +
                       "; this loader runs CPU packages only. Re-export with `embserve export --pt2` for cpu, " +
                       "or load with the TorchScript backend");
    check_pt2_torch_version(pt2["torch_version"].get<std::string>(), pt2_path.string());
    // one range per core unless told otherwise; each range runs on its own runner (model instance)
    const auto cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    model.pt2_threads_ = options.kernel_threads < 0 ? cores : std::max(1, options.kernel_threads);
    model.program_path_ = pt2_path.string();
    const auto runners = static_cast<size_t>(std::max(model.pt2_threads_, 2));
    try {
      model.pt2_ = std::make_shared<torch::inductor::AOTIModelPackageLoader>(
          pt2_path.string(), "model", /*run_single_threaded=*/false, /*num_runners=*/runners);
      // the dense part, a second program of the same package: (dense_features, pooled) -> scores
      if (pt2.contains("dense_program") && !pt2["dense_program"].is_null())
        model.pt2_dense_ = std::make_shared<torch::inductor::AOTIModelPackageLoader>(
            pt2_path.string(), pt2["dense_program"].get<std::string>(), /*run_single_threaded=*/false,
            /*num_runners=*/runners);
    } catch (const std::exception& err) {
      throw ModelError(pt2_path.string() + " cannot be loaded by AOTInductor: " + cause_of(err) +
                       " (are the fbgemm libraries in the manifest's fbgemm.libraries the ones it was compiled with?)");
    }
    if (options.intra_op_threads > 0) at::set_num_threads(options.intra_op_threads);
    check_pt2_block_remaps(*model.pt2_, data, pt2_path.string());
    verified();  // before any weight file is handed to the program
    model.pt2_mappings_ = attach_pt2_weights(*model.pt2_, data, mappings, pt2_path.string());
    model.load_seconds_ = seconds_since(started);
    return model;
  }

  fs::path model_path = folder / model_file;
  model.program_path_ = model_path.string();
  try {
    model.module_ = std::make_shared<torch::jit::Module>(torch::jit::load(model_path.string()));
    model.module_->eval();
  } catch (const std::exception& err) {
    verified();  // a corrupted file explains a failed load better than TorchScript's message
    throw ModelError(model_path.string() + " cannot be loaded by TorchScript: " + first_line(message_of(err)) +
                     " (are the fbgemm libraries in the manifest's fbgemm.libraries the ones it was exported with?)");
  }
  // as Runtime.plain_execution: a model whose kernels are all on CPU runs its methods unoptimized
  model.plain_execution_ = std::all_of(data["kernels"].begin(), data["kernels"].end(),
                                       [](const auto& kernel) { return kernel["device"] == "cpu"; });
  auto method = [&](const char* name) -> std::shared_ptr<const torch::jit::Method> {
    auto found = model.module_->find_method(name);
    if (!found) return nullptr;
    return std::make_shared<const torch::jit::Method>(*found);
  };
  model.lookup_unchecked_ = method("lookup_unchecked");
  model.lookup_and_predict_unchecked_ = method("lookup_and_predict_unchecked");
  model.lookup_and_predict_ = method("lookup_and_predict");
  // batch-parallel kernels, as Python's load: cores shared by the CPU kernels unless the options say otherwise
  int kernel_threads = options.kernel_threads;
  if (kernel_threads < 0) {
    int64_t cpu_kernels = 0;
    for (const auto& kernel : data["kernels"]) cpu_kernels += kernel["device"] == "cpu" ? 1 : 0;
    const auto cores = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
    kernel_threads = static_cast<int>(std::max<int64_t>(1, cores / std::max<int64_t>(1, cpu_kernels)));
  }
  if (is_mapped(data)) attach_weights(*model.module_, data, mappings, model_path.string());
  verified();  // before the kernel checks read the weights' sizes and the first lookup reads the rows
  check_kernels(*model.module_, data, routing, model_path.string(), kernel_threads);
  check_block_model(*model.module_, data, routing, model_path.string());

  int threads = options.intra_op_threads;
  if (threads < 0 && model.world_size_ >= 2) {
    bool all_cpu = std::all_of(devices.begin(), devices.end(), [](const std::string& d) { return d == "cpu"; });
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    if (all_cpu) threads = std::max(1, static_cast<int>(cores) / model.world_size_);
  }
  if (threads > 0) at::set_num_threads(threads);
  model.build_direct_plan();
  // as Python's prefetch_wanted: an embedded artifact has nothing to read ahead, whatever the mode
  if (is_mapped(data)) model.build_prefetch(options.prefetch, plan_has_paged_tier(folder, data));
  if (!options.hot_rows.empty()) {
    if (!is_mapped(data))
      throw ConfigError("hot_rows needs a mapped artifact (export with weights='mapped'); " + artifact_dir +
                        " embeds its weights");
    model.build_hot_rows(options.hot_rows);
  }
  model.load_seconds_ = seconds_since(started);
  return model;
}

void Model::build_prefetch(Prefetch mode, bool paged_plan) {
  if (mode == Prefetch::Off || backend_ != Backend::TorchScript || (mode == Prefetch::Auto && !paged_plan)) return;
  const std::optional<torch::jit::Module> tbe = module_ ? single_cpu_kernel(*module_, program_path_) : std::nullopt;
  if (!tbe) {
    if (mode == Prefetch::On)
      throw ConfigError("prefetch='on': " + path_ + " is sharded or not on the CPU; this loader reads ahead for an " +
                        "unsharded CPU model only (serve it with the Python server, or export it unsharded)");
    return;
  }
  const at::Tensor host = tbe->attr("weights_host").toTensor();
  const at::Tensor offsets = tbe->attr("weights_offsets").toTensor().to(at::kLong);
  const at::Tensor d_offsets = tbe->attr("D_offsets").toTensor().to(at::kLong);
  const at::Tensor types = tbe->attr("weights_tys").toTensor().to(at::kLong);
  const int64_t alignment = std::max<int64_t>(1, tbe->attr("row_alignment").toInt());
  std::vector<prefetch::Region> regions;
  for (size_t f = 0; f < features_.size(); ++f) {
    const auto i = static_cast<int64_t>(f);
    if (offsets.numel() != static_cast<int64_t>(features_.size())) break;
    const int64_t dim = d_offsets[i + 1].item<int64_t>() - d_offsets[i].item<int64_t>();
    const int64_t type = types[i].item<int64_t>();
    // fbgemm SparseType: FP32 0, FP16 1, INT8 2, INT4 3, INT2 4 (rowwise.unpadded_row_bytes)
    const int64_t width = type == 0 ? dim * 4 : type == 1 ? dim * 2 : type == 2 ? dim + 4 : type == 3 ? dim / 2 + 4
                        : type == 4 ? dim / 4 + 4 : dim;
    const int64_t stride = (width + alignment - 1) / alignment * alignment;
    const int64_t start = offsets[i].item<int64_t>();
    const int64_t rows = features_[f].num_embeddings;
    if (start < 0 || start + rows * stride > host.numel()) {
      regions.push_back({});
      continue;
    }
    regions.push_back({host.data_ptr<uint8_t>() + start, stride, rows});
  }
  prefetch_ = std::make_shared<prefetch::Prefetcher>(std::move(regions));
  prefetch_->advise_random();
}

void Model::read_ahead(const at::Tensor& values, const at::Tensor& lengths) const {
  if (prefetch_) prefetch_->prefetch(values, lengths);
}

void Model::build_hot_rows(const HotRows& rows) {
  // the cache reads rows from the one kernel of an unsharded CPU model (Python's reads any mapped layout; the
  // sharded ones are left to it for now)
  const std::optional<torch::jit::Module> tbe = single_cpu_kernel(*module_, program_path_);
  if (!tbe)
    throw ConfigError("hot_rows: " + path_ + " is sharded or not on the CPU; this loader caches rows of an " +
                      "unsharded CPU model only (serve it with the Python server, or export it unsharded)");
  hot_ = std::make_shared<const hot_rows::HotRowCache>(*tbe, features_, rows, program_path_);
}

HotRowCacheInfo Model::hot_row_cache() const {
  if (!hot_) return {};
  return {hot_->rows(), hot_->tables(), hot_->bytes()};
}

HotRows read_hot_rows(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot read the hot-rows file " + path + "; write JSON {\"table\": [row, ...]}");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json document;
  try {
    document = nlohmann::json::parse(text.str());
  } catch (const std::exception& err) {
    throw ConfigError("the hot-rows file " + path + " is not JSON (" + first_line(err.what()) +
                      "); write JSON {\"table\": [row, ...]}");
  }
  if (!document.is_object())
    throw ConfigError("the hot-rows file " + path + " holds " + std::string(document.type_name()) +
                      ", not an object; write JSON {\"table\": [row, ...]}");
  HotRows rows;
  for (const auto& [table, ids] : document.items()) {
    std::vector<int64_t> list;
    if (ids.is_array()) {
      list.reserve(ids.size());
      for (const auto& id : ids) {
        if (!id.is_number_integer()) {
          list.clear();
          break;
        }
        list.push_back(id.get<int64_t>());
      }
    }
    if (!ids.is_array() || list.size() != ids.size())
      throw ConfigError("the hot-rows file " + path + ": table '" + table +
                        "' must map to a list of integer row ids, got " + first_line(ids.dump()).substr(0, 80));
    rows.emplace_back(table, std::move(list));
  }
  return rows;
}

// fbgemm's CPU kernel of int_nbit_split_embedding_codegen_lookup_function as it registers it (by value): the typed
// handle calls it unboxed, without packing 23 arguments into IValues and out again
using TbeLookupSignature = at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
                                      int64_t, int64_t, int64_t, int64_t, int64_t, at::Tensor, at::Tensor, int64_t,
                                      std::optional<at::Tensor>, int64_t, std::optional<at::Tensor>,
                                      std::optional<at::Tensor>, std::optional<int64_t>, std::optional<int64_t>,
                                      std::optional<int64_t>, std::optional<int64_t>);

struct Model::DirectPlan {
  explicit DirectPlan(c10::OperatorHandle handle) : op(std::move(handle)) {}
  c10::OperatorHandle op;
  // the same op, typed (looked up once): set when the registered kernel has TbeLookupSignature, else the boxed call
  std::optional<c10::TypedOperatorHandle<TbeLookupSignature>> typed;
  // the head's arguments unpacked for the typed call
  std::array<at::Tensor, 6> tensors;
  std::array<int64_t, 6> dims{};
  std::optional<at::Tensor> cache_weights;
  std::optional<int64_t> alignment, float8_D, exponent_bits, exponent_bias;
  std::vector<c10::IValue> head;  // the op's arguments before indices (dev_weights .. max_float32_D)
  int64_t pooling_mode = 0, output_dtype = 1;
  c10::IValue lxu_cache_weights, row_alignment, max_float8_D, fp8_exponent_bits, fp8_exponent_bias;
  at::Tensor no_cache_locations;
  int64_t num_features = 0, threads = 1, min_ids_per_chunk = 1;
  std::vector<std::array<int64_t, 3>> means;  // (feature, first column, end column) of each MEAN feature

  // KernelRunner.chunks_for: a batch the script would split over its kernel threads keeps the script's parallel
  // path; one range is answered here
  bool answers(const at::Tensor& values, const at::Tensor& lengths) const {
    if (num_features <= 0) return false;
    const int64_t batch = lengths.numel() / num_features;
    return threads <= 1 || std::min({threads, batch, values.numel() / min_ids_per_chunk}) <= 1;
  }
};

namespace {
int64_t int_attr(const torch::jit::Module& m, const char* name) {
  const c10::IValue v = m.attr(name);
  if (v.isEnum()) return v.toEnumHolder()->value().toInt();
  return v.toInt();
}
}  // namespace

// The direct plan, only for what the loader can prove the scripted lookup_unchecked computes as one op call
// (KernelRunner.kernel's direct branch, infer/modules/tbe.py) plus apply_mean (infer/modules/collection.py);
// anything else keeps the TorchScript path.
void Model::build_direct_plan() {
  if (const char* env = std::getenv("EMBSERVE_FORCE_TORCHSCRIPT"); env && *env && std::string(env) != "0") return;
  if (backend_ != Backend::TorchScript || !module_ || !lookup_unchecked_) return;
  try {
    const torch::jit::Module embeddings = module_->attr("embeddings").toModule();
    if (embeddings.hasattr("shards") || !embeddings.hasattr("has_blocks") || embeddings.attr("has_blocks").toBool())
      return;
    if (!embeddings.hasattr("direct_kernel") || !embeddings.attr("direct_kernel").toBool()) return;
    if (embeddings.attr("kernel_device").toStringRef() != "cpu") return;
    const torch::jit::Module tbe = embeddings.attr("tbe").toModule();
    auto plan = std::make_shared<DirectPlan>(
        c10::Dispatcher::singleton().findSchemaOrThrow("fbgemm::int_nbit_split_embedding_codegen_lookup_function", ""));
    plan->head = {int_attr(tbe, "host_size") > 0 ? tbe.attr("weights_host") : tbe.attr("weights_dev"),
                  tbe.attr("weights_uvm"),
                  tbe.attr("weights_placements"),
                  tbe.attr("weights_offsets"),
                  tbe.attr("weights_tys"),
                  tbe.attr("D_offsets"),
                  int_attr(tbe, "total_D"),
                  int_attr(tbe, "max_int2_D"),
                  int_attr(tbe, "max_int4_D"),
                  int_attr(tbe, "max_int8_D"),
                  int_attr(tbe, "max_float16_D"),
                  int_attr(tbe, "max_float32_D")};
    plan->pooling_mode = int_attr(tbe, "pooling_mode");
    plan->output_dtype = int_attr(tbe, "output_dtype");
    plan->lxu_cache_weights = tbe.attr("lxu_cache_weights");
    plan->row_alignment = tbe.attr("row_alignment");
    plan->max_float8_D = tbe.attr("max_float8_D");
    plan->fp8_exponent_bits = tbe.attr("fp8_exponent_bits");
    plan->fp8_exponent_bias = tbe.attr("fp8_exponent_bias");
    plan->no_cache_locations = at::empty({0}, at::TensorOptions().dtype(at::kInt));
    plan->num_features = embeddings.attr("num_features").toInt();
    plan->threads = embeddings.attr("threads").toInt();
    plan->min_ids_per_chunk = std::max<int64_t>(1, embeddings.attr("min_ids_per_chunk").toInt());
    if (embeddings.attr("range_features").toInt() != plan->num_features) return;
    try {
      plan->typed = plan->op.typed<TbeLookupSignature>();
      for (size_t i = 0; i < plan->tensors.size(); ++i) plan->tensors[i] = plan->head[i].toTensor();
      for (size_t i = 0; i < plan->dims.size(); ++i) plan->dims[i] = plan->head[6 + i].toInt();
      auto optional_int = [](const c10::IValue& v) {
        return v.isNone() ? std::nullopt : std::optional<int64_t>(v.toInt());
      };
      plan->cache_weights = plan->lxu_cache_weights.isNone() ? std::nullopt
                                                             : std::optional<at::Tensor>(plan->lxu_cache_weights.toTensor());
      plan->alignment = optional_int(plan->row_alignment);
      plan->float8_D = optional_int(plan->max_float8_D);
      plan->exponent_bits = optional_int(plan->fp8_exponent_bits);
      plan->exponent_bias = optional_int(plan->fp8_exponent_bias);
    } catch (const std::exception&) {
      plan->typed.reset();  // another fbgemm registers another signature: the boxed call
    }
    const auto starts = embeddings.attr("column_starts").toIntVector();
    const auto dims = embeddings.attr("feature_dims").toIntVector();
    for (const int64_t f : embeddings.attr("mean_features").toIntVector())
      plan->means.push_back({f, starts.at(f), starts.at(f) + dims.at(f)});
    direct_ = std::move(plan);
  } catch (const std::exception&) {
    direct_.reset();  // an attribute this loader does not know: the TorchScript path
  }
}

namespace {
// bag offsets (0, then the running sum of lengths) in the ids' dtype, written into `out`
template <typename Offset, typename Length>
void running_sum(Offset* out, const Length* lengths, int64_t n) {
  int64_t sum = 0;
  out[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    sum += static_cast<int64_t>(lengths[i]);
    out[i + 1] = static_cast<Offset>(sum);
  }
}

// The bag offsets of one call in this thread's buffer of `type` (reused from call to call: no allocation and no
// dispatcher op per call); the tensor is this thread's until its next call.
const at::Tensor& offsets_of(const at::Tensor& lengths, at::ScalarType type) {
  thread_local at::Tensor buffers[2];  // int32, int64
  at::Tensor& buffer = buffers[type == at::kLong ? 1 : 0];
  const int64_t n = lengths.numel() + 1;
  if (!buffer.defined() || buffer.storage().nbytes() < static_cast<size_t>(n) * buffer.element_size())
    buffer = at::empty({std::max<int64_t>(n, 4096)}, at::TensorOptions().dtype(type));
  buffer.unsafeGetTensorImpl()->set_sizes_contiguous({n});
  const bool wide_lengths = lengths.scalar_type() == at::kLong;
  if (type == at::kLong) {
    if (wide_lengths) running_sum(buffer.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), n - 1);
    else running_sum(buffer.data_ptr<int64_t>(), lengths.data_ptr<int32_t>(), n - 1);
  } else {
    if (wide_lengths) running_sum(buffer.data_ptr<int32_t>(), lengths.data_ptr<int64_t>(), n - 1);
    else running_sum(buffer.data_ptr<int32_t>(), lengths.data_ptr<int32_t>(), n - 1);
  }
  return buffer;
}
}  // namespace

// As KernelRunner.pool (one chunk) + apply_mean: bag_offsets in the ids' dtype, the op, MEAN by float division.
at::Tensor Model::lookup_direct(const DirectPlan& plan, const at::Tensor& values, const at::Tensor& lengths,
                                const std::optional<at::Tensor>& weights) const {
  c10::InferenceMode guard;
  at::Tensor out;
  const bool plain = lengths.is_cpu() && lengths.is_contiguous() && values.is_cpu() &&
                     (lengths.scalar_type() == at::kLong || lengths.scalar_type() == at::kInt) &&
                     (values.scalar_type() == at::kLong || values.scalar_type() == at::kInt);
  if (plan.typed && plain) {
    // the typed op on this thread's offsets buffer: the same op on the same argument values as the boxed call
    const at::Tensor& offsets = offsets_of(lengths, values.scalar_type());
    out = plan.typed->call(plan.tensors[0], plan.tensors[1], plan.tensors[2], plan.tensors[3], plan.tensors[4],
                           plan.tensors[5], plan.dims[0], plan.dims[1], plan.dims[2], plan.dims[3], plan.dims[4],
                           plan.dims[5], values, offsets, plan.pooling_mode, weights, plan.output_dtype,
                           plan.cache_weights, plan.no_cache_locations, plan.alignment, plan.float8_D,
                           plan.exponent_bits, plan.exponent_bias);
  } else {
    at::Tensor offsets = at::zeros({lengths.numel() + 1}, values.options());
    offsets.slice(0, 1).copy_(at::cumsum(lengths, 0).to(values.scalar_type()));
    torch::jit::Stack stack(plan.head);
    stack.reserve(23);
    stack.emplace_back(values);
    stack.emplace_back(offsets);
    stack.emplace_back(plan.pooling_mode);
    stack.emplace_back(weights ? c10::IValue(*weights) : c10::IValue());
    stack.emplace_back(plan.output_dtype);
    stack.emplace_back(plan.lxu_cache_weights);
    stack.emplace_back(plan.no_cache_locations);
    stack.emplace_back(plan.row_alignment);
    stack.emplace_back(plan.max_float8_D);
    stack.emplace_back(plan.fp8_exponent_bits);
    stack.emplace_back(plan.fp8_exponent_bias);
    plan.op.callBoxed(&stack);
    out = stack.back().toTensor();
  }
  if (!plan.means.empty()) {
    const int64_t batch = lengths.numel() / plan.num_features;
    const at::Tensor counts =
        lengths.view({plan.num_features, batch}).to(out.device(), out.scalar_type()).clamp(1.0);
    for (const auto& [f, start, end] : plan.means) out.slice(1, start, end).div_(counts[f].unsqueeze(1));
  }
  return out;
}

std::vector<std::string> Model::feature_names() const {
  std::vector<std::string> names;
  for (const auto& f : features_) names.push_back(f.name);
  return names;
}

// The request rules. Every sentence below is worded exactly as in infer/request_rules.py (Python, TorchScript
// and the server use that module); tests/support/bad_requests.py holds all entry points to the same fragments.
namespace {
// The call contract's rules (request_rules IDS_DTYPE, LENGTHS_DTYPE, WEIGHTS_DTYPE, DENSE_DTYPE, NO_DENSE_PART).
constexpr const char* kIdsDtype = "values must be a 1-D int64 or int32 tensor of ids";
constexpr const char* kLengthsDtype = "lengths must be a 1-D int32 (or int64) tensor";
constexpr const char* kWeightsDtype = "weights must be a 1-D float32 tensor with one weight per id";
constexpr const char* kDenseDtype = "dense_features must be float32 [batch, num_dense_features]";
constexpr const char* kNoDensePart = "this model has no dense part; use lookup, not predict";

// A dtype as request_rules.dtype_name writes it: float32, int64, ...
std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return std::string("dtype ") + c10::toString(type);
  }
}

// A shape as Python prints a list: [2, 3]
std::string shape_text(const at::Tensor& tensor) {
  std::string text = "[";
  for (int64_t d = 0; d < tensor.dim(); ++d) text += (d ? ", " : "") + std::to_string(tensor.size(d));
  return text + "]";
}

// request_rules.dtype_error: the rule the tensor breaks, then what it was.
std::string dtype_error(const char* rule, const at::Tensor& tensor) {
  return std::string(rule) + ", got " +
         (tensor.defined() ? dtype_name(tensor.scalar_type()) + " " + shape_text(tensor) : "an undefined tensor");
}

// The contract for one tensor: defined, `dims`-D, one of the accepted dtypes, on the CPU.
void check_tensor(const char* name, const char* rule, const at::Tensor& tensor, int64_t dims,
                  std::initializer_list<at::ScalarType> accepted) {
  if (!tensor.defined() || tensor.dim() != dims ||
      std::find(accepted.begin(), accepted.end(), tensor.scalar_type()) == accepted.end())
    throw RequestError(dtype_error(rule, tensor));
  if (!tensor.device().is_cpu())
    throw RequestError(std::string(name) + " must be a CPU tensor, got one on " + tensor.device().str());
}

std::string to_string_wide(__int128 value) {
  if (value >= INT64_MIN && value <= INT64_MAX) return std::to_string(static_cast<int64_t>(value));
  std::string digits;
  const bool negative = value < 0;
  unsigned __int128 magnitude = negative ? -static_cast<unsigned __int128>(value) : static_cast<unsigned __int128>(value);
  while (magnitude > 0) {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(magnitude % 10)));
    magnitude /= 10;
  }
  return negative ? "-" + digits : digits;
}

// infer.request_rules.feature_list: the model's first five features, then how many more.
std::string feature_list(const std::vector<FeatureInfo>& features) {
  std::string text = "[";
  for (size_t f = 0; f < std::min<size_t>(features.size(), 5); ++f) text += (f ? ", '" : "'") + features[f].name + "'";
  text += "]";
  if (features.size() > 5) text += " and " + std::to_string(features.size() - 5) + " more";
  return text;
}

// infer.request_rules.uneven_batch, word for word.
std::string uneven_batch(int64_t entries, const std::vector<FeatureInfo>& features) {
  const std::string count = std::to_string(features.size());
  return "lengths has " + std::to_string(entries) + " entries, not a multiple of the " + count + " features " +
         feature_list(features) + ": it holds one bag length per example and feature (batch size x " + count +
         " entries, feature-major), so the features have inconsistent batch sizes";
}

// Sums are 128-bit: with every length checked against the ids count first, n lengths of at most 2^63
// each cannot wrap, so a wrapping int64 request is reported with its true total, never a bogus one.
template <typename T>
void check_lengths(const at::Tensor& lengths, const std::vector<FeatureInfo>& features, int64_t batch,
                   int64_t num_ids, std::vector<int64_t>& per_feature) {
  const T* data = lengths.data_ptr<T>();
  __int128 total = 0;
  std::vector<__int128> sums(per_feature.size(), 0);
  for (int64_t i = 0; i < lengths.numel(); ++i) {
    if (data[i] < 0)
      throw RequestError("feature '" + features[static_cast<size_t>(i / batch)].name + "': bag " +
                         std::to_string(i % batch) + " has negative length " + std::to_string(data[i]));
    if (static_cast<int64_t>(data[i]) > num_ids)  // before summing: huge lengths could wrap the sum around
      throw RequestError("feature '" + features[static_cast<size_t>(i / batch)].name + "': bag " +
                         std::to_string(i % batch) + " has length " + std::to_string(data[i]) +
                         " but the batch has only " + std::to_string(num_ids) + " ids");
    sums[static_cast<size_t>(i / batch)] += data[i];
    total += data[i];
  }
  if (total != num_ids)
    throw RequestError("lengths sum to " + to_string_wide(total) + " but there are " + std::to_string(num_ids) +
                       " ids; lengths must add up to the number of ids");
  for (size_t f = 0; f < sums.size(); ++f) per_feature[f] = static_cast<int64_t>(sums[f]);  // each <= total
}

template <typename T>
void check_ids(const at::Tensor& values, const std::vector<FeatureInfo>& features,
               const std::vector<int64_t>& per_feature) {
  const T* data = values.data_ptr<T>();
  int64_t start = 0;
  for (size_t f = 0; f < features.size(); ++f) {
    const int64_t rows = features[f].num_embeddings;
    const int64_t end = start + per_feature[f];
    for (int64_t i = start; i < end; ++i) {
      const int64_t id = static_cast<int64_t>(data[i]);
      if (id < 0 || id >= rows)
        throw RequestError("feature '" + features[f].name + "': id " + std::to_string(id) + " is out of range [0, " +
                           std::to_string(rows) + ") (id #" + std::to_string(i - start) + " of the feature)");
    }
    start = end;
  }
}
}  // namespace

void Model::validate(const at::Tensor& values, const at::Tensor& lengths,
                     const std::optional<at::Tensor>& weights) const {
  check_tensor("values", kIdsDtype, values, 1, {at::kLong, at::kInt});
  check_tensor("lengths", kLengthsDtype, lengths, 1, {at::kInt, at::kLong});
  const int64_t num_features = static_cast<int64_t>(features_.size());
  if (lengths.numel() % num_features != 0)
    throw RequestError(uneven_batch(lengths.numel(), features_));
  const int64_t batch = lengths.numel() / num_features;
  std::vector<int64_t> per_feature(features_.size(), 0);
  at::Tensor lengths_c = lengths.contiguous();
  if (lengths_c.scalar_type() == at::kInt)
    check_lengths<int32_t>(lengths_c, features_, batch, values.numel(), per_feature);
  else
    check_lengths<int64_t>(lengths_c, features_, batch, values.numel(), per_feature);
  if (weights.has_value() && weights->defined()) {
    const auto& w = *weights;
    check_tensor("weights", kWeightsDtype, w, 1, {at::kFloat});
    if (w.numel() != values.numel())
      throw RequestError("weights has " + std::to_string(w.numel()) + " entries but there are " +
                         std::to_string(values.numel()) + " ids; give one weight per id");
  }
  at::Tensor values_c = values.contiguous();
  if (values_c.scalar_type() == at::kInt)
    check_ids<int32_t>(values_c, features_, per_feature);
  else
    check_ids<int64_t>(values_c, features_, per_feature);
}

namespace {
// A scripted method's arguments: the tensors, then the optional weights (None when absent).
std::vector<c10::IValue> script_inputs(std::initializer_list<at::Tensor> tensors,
                                       const std::optional<at::Tensor>& weights) {
  std::vector<c10::IValue> inputs;
  inputs.reserve(tensors.size() + 1);
  for (const auto& tensor : tensors) inputs.emplace_back(tensor);
  if (weights.has_value() && weights->defined())
    inputs.emplace_back(*weights);
  else
    inputs.emplace_back(c10::IValue());
  return inputs;
}

// Around a TorchScript call: inference mode, and for a plain-execution model the graph executor's optimizer off on
// this thread (restored after; Python's torch.jit.optimized_execution(False)).
struct ScriptCall {
  explicit ScriptCall(bool plain) {
    if (plain) optimizer.emplace(false);
  }
  c10::InferenceMode inference;
  std::optional<torch::jit::GraphOptimizerEnabledGuard> optimizer;
};
}  // namespace

at::Tensor Model::lookup(const at::Tensor& values, const at::Tensor& lengths,
                         const std::optional<at::Tensor>& weights) const {
  validate(values, lengths, weights);
  if (hot_) return lookup_cached(values, lengths, weights);  // PagedModel.forward: validated, then split
  read_ahead(values, lengths);
  if (backend_ == Backend::Pt2) return lookup_pt2(values, lengths, weights);
  if (direct_ && direct_->answers(values, lengths)) return lookup_direct(*direct_, values, lengths, weights);
  ScriptCall call(plain_execution_);
  try {
    return module_->forward(script_inputs({values, lengths}, weights)).toTensor();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    rethrow_script_error(err);
  }
}

namespace {
// A range of fewer ids than this stays on the calling thread (as infer.modules.tbe.MIN_IDS_PER_CHUNK).
constexpr int64_t kMinIdsPerChunk = 4096;

// All-ones weights (a weight of 1.0 leaves every product exact, so the weighted program pools as the unweighted
// model does), filled on the calling thread: no OpenMP region for it (at::ones opens one for a large batch).
at::Tensor unit_weights(int64_t count) {
  at::Tensor ones = at::empty({count}, at::TensorOptions().dtype(at::kFloat));
  std::fill_n(ones.data_ptr<float>(), count, 1.0f);
  return ones;
}

at::Tensor run_program(torch::inductor::AOTIModelPackageLoader& program, at::Tensor values, at::Tensor lengths,
                       at::Tensor weights) {
  c10::InferenceMode guard;
  std::vector<at::Tensor> outputs = program.run({std::move(values), std::move(lengths), std::move(weights)});
  if (outputs.size() != 1) throw ModelError("model.pt2 returned " + std::to_string(outputs.size()) + " outputs, not 1");
  return outputs[0];
}

// One split lookup: its example ranges, claimed one at a time by the calling thread and by helpers on torch's
// inter-op pool (at::launch, as TorchScript's fork). The caller waits only for ranges already claimed, so a
// busy or exhausted pool delays nothing and cannot deadlock; a helper that starts late finds no range left and
// touches nothing but this (shared) state.
struct SplitLookup {
  torch::inductor::AOTIModelPackageLoader* program = nullptr;
  at::Tensor ids, lengths, weights;
  std::vector<int64_t> offsets;  // offsets[f * batch + b]: where bag b of feature f starts in ids
  int64_t num_features = 0, batch = 0, chunks = 0;
  std::atomic<int64_t> next{0};
  std::mutex mutex;
  std::condition_variable finished;
  int64_t done = 0;
  std::vector<at::Tensor> pooled;
  std::exception_ptr error;

  at::Tensor run_range(int64_t k) {
    const int64_t first = k * batch / chunks, last = (k + 1) * batch / chunks;
    std::vector<at::Tensor> range_ids, range_lengths, range_weights;
    for (int64_t f = 0; f < num_features; ++f) {
      const int64_t start = offsets[static_cast<size_t>(f * batch + first)];
      const int64_t end = offsets[static_cast<size_t>(f * batch + last)];
      range_ids.push_back(ids.slice(0, start, end));
      range_weights.push_back(weights.slice(0, start, end));
      range_lengths.push_back(lengths.slice(0, f * batch + first, f * batch + last));
    }
    return run_program(*program, at::cat(range_ids), at::cat(range_lengths), at::cat(range_weights));
  }

  static void work(const std::shared_ptr<SplitLookup>& state) {
    for (int64_t k = state->next.fetch_add(1); k < state->chunks; k = state->next.fetch_add(1)) {
      at::Tensor out;
      std::exception_ptr failure;
      try {
        out = state->run_range(k);
      } catch (...) {
        failure = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(state->mutex);
      state->pooled[static_cast<size_t>(k)] = std::move(out);
      if (failure && !state->error) state->error = failure;
      if (++state->done == state->chunks) state->finished.notify_all();
    }
  }
};
}  // namespace

// The program takes (values int64[N], lengths int64[F*B], weights float32[N]) and returns [B, output_dim]
// float32 exactly as model.pt's forward. A large batch is cut into contiguous example ranges, each gathered
// into its own (values, lengths, weights) and run in parallel (SplitLookup); every bag is pooled by one run
// either way, so the concatenated rows are the single run's, bit for bit.
at::Tensor Model::lookup_pt2(const at::Tensor& values, const at::Tensor& lengths,
                             const std::optional<at::Tensor>& weights) const {
  const int64_t num_features = static_cast<int64_t>(features_.size());
  const int64_t batch = lengths.numel() / num_features;
  at::Tensor ids = values.to(at::kLong).contiguous();
  at::Tensor bag_lengths = lengths.to(at::kLong).contiguous();
  at::Tensor id_weights = weights.has_value() && weights->defined() ? weights->contiguous() : unit_weights(ids.numel());
  if (batch == 0) return at::zeros({0, output_dim_}, at::TensorOptions().dtype(at::kFloat));
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>({static_cast<int64_t>(pt2_threads_), batch, ids.numel() / kMinIdsPerChunk}));
  try {
    if (chunks <= 1) return run_program(*pt2_, ids, bag_lengths, id_weights);
    auto state = std::make_shared<SplitLookup>();
    state->program = pt2_.get();
    state->ids = ids;
    state->lengths = bag_lengths;
    state->weights = id_weights;
    state->num_features = num_features;
    state->batch = batch;
    state->chunks = chunks;
    state->pooled.resize(static_cast<size_t>(chunks));
    state->offsets.assign(static_cast<size_t>(bag_lengths.numel()) + 1, 0);
    const int64_t* length_data = bag_lengths.data_ptr<int64_t>();
    for (int64_t i = 0; i < bag_lengths.numel(); ++i)
      state->offsets[static_cast<size_t>(i) + 1] = state->offsets[static_cast<size_t>(i)] + length_data[i];
    for (int64_t k = 0; k + 1 < chunks; ++k) at::launch([state] { SplitLookup::work(state); });
    SplitLookup::work(state);  // the calling thread claims ranges too instead of idling
    std::unique_lock<std::mutex> lock(state->mutex);
    state->finished.wait(lock, [&] { return state->done == state->chunks; });
    if (state->error) std::rethrow_exception(state->error);
    return at::cat(state->pooled, 0);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    rethrow_script_error(err);
  }
}

namespace {
// request_rules.scores_of: predict returns float32 [batch] on every backend; a dense part's [batch, 1] is squeezed
// and another floating dtype cast, anything else is a broken model (export probes the dense part with the same rule).
at::Tensor scores_of(const at::Tensor& out, int64_t batch, const std::string& program) {
  at::Tensor scores = out.dim() == 2 && out.size(1) == 1 ? out.squeeze(1) : out;
  if (scores.dim() != 1 || scores.size(0) != batch || !at::isFloatingType(scores.scalar_type()))
    throw ModelError(program + ": the dense part returned " + dtype_name(out.scalar_type()) + " " + shape_text(out) +
                     " for a batch of " + std::to_string(batch) + "; predict returns float32 scores [batch], so the " +
                     "dense part must return floating-point [B] or [B, 1] (squeeze or slice its output to one score " +
                     "per example) and the model be exported again");
  return scores.to(at::kFloat).contiguous();
}
}  // namespace

// In the scripted model's order: the dtype of a 2-D tensor, then its shape (request_rules.dense_shape).
void Model::validate_dense(const at::Tensor& dense_features, int64_t batch) const {
  if (dense_features.defined() && dense_features.dim() == 2)
    check_tensor("dense_features", kDenseDtype, dense_features, 2, {at::kFloat});
  if (!dense_features.defined() || dense_features.dim() != 2 || dense_features.size(0) != batch ||
      dense_features.size(1) != num_dense_features_)
    throw RequestError("dense_features must have shape [" + std::to_string(batch) + ", " +
                       std::to_string(num_dense_features_) + "], got " +
                       (dense_features.defined() ? shape_text(dense_features) : "an undefined tensor"));
}

at::Tensor Model::predict(const at::Tensor& dense_features, const at::Tensor& values, const at::Tensor& lengths,
                          const std::optional<at::Tensor>& weights) const {
  if (!has_dense()) throw RequestError(kNoDensePart);
  if (backend_ == Backend::Pt2) check_dense_program();
  validate(values, lengths, weights);
  const int64_t batch = lengths.numel() / static_cast<int64_t>(features_.size());
  validate_dense(dense_features, batch);
  try {
    if (backend_ == Backend::Pt2) {
      // the dense program was exported for batch >= 1; an empty batch has no scores to compute
      if (batch == 0) return at::empty({0}, at::TensorOptions().dtype(at::kFloat));
      return score_pt2(dense_features, lookup_pt2(values, lengths, weights), batch);
    }
    if (hot_) return score(dense_features, lookup_cached(values, lengths, weights), batch);
    read_ahead(values, lengths);
    ScriptCall call(plain_execution_);
    at::Tensor out = module_->get_method("predict")(script_inputs({dense_features, values, lengths}, weights)).toTensor();
    return scores_of(out, batch, program_path_);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    rethrow_script_error(err);
  }
}

void Model::check_dense_program() const {
  if (!pt2_dense_)
    throw ModelError(program_path_ + " holds the lookups only: the manifest's pt2.dense_program is not set (export " +
                     "could not compile the dense part with torch.export); predict with the TorchScript backend, " +
                     "or re-export with a dense part torch.export can trace");
}

// model.pt2's dense program (check_dense_program first) on the pooled lookups of a batch of `batch` >= 1 examples
at::Tensor Model::score_pt2(const at::Tensor& dense_features, const at::Tensor& pooled, int64_t batch) const {
  c10::InferenceMode guard;
  std::vector<at::Tensor> outputs = pt2_dense_->run({dense_features.contiguous(), pooled});
  if (outputs.size() != 1)
    throw ModelError(program_path_ + ": the dense program returned " + std::to_string(outputs.size()) +
                     " outputs, not 1");
  return scores_of(outputs[0], batch, program_path_);
}

at::Tensor Model::lookup_unchecked(const at::Tensor& values, const at::Tensor& lengths,
                                   const std::optional<at::Tensor>& weights) const {
  if (hot_) return lookup_cached(values, lengths, weights);
  return lookup_model(values, lengths, weights);
}

// PagedModel._cached: the batch split once, the model's share (cut from a validated batch, so well formed too) to
// its unchecked entry, the cache's sums added into its output.
at::Tensor Model::lookup_cached(const at::Tensor& values, const at::Tensor& lengths,
                                const std::optional<at::Tensor>& weights) const {
  const hot_rows::HotRowCache::Split split = hot_->split(values, lengths, weights);
  at::Tensor out = lookup_model(split.cold_values, split.cold_lengths, split.cold_weights);
  hot_->add(out, lengths, split);
  return out;
}

at::Tensor Model::score(const at::Tensor& dense_features, const at::Tensor& pooled, int64_t batch) const {
  ScriptCall call(plain_execution_);
  try {
    return scores_of(module_->get_method("score")({dense_features, pooled}).toTensor(), batch, program_path_);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    rethrow_script_error(err);
  }
}

at::Tensor Model::lookup_model(const at::Tensor& values, const at::Tensor& lengths,
                               const std::optional<at::Tensor>& weights) const {
  read_ahead(values, lengths);  // PagedModel: the pages of the ids the model reads (the cold ones, with a cache)
  if (backend_ == Backend::Pt2) return lookup_pt2(values, lengths, weights);
  if (direct_ && direct_->answers(values, lengths)) return lookup_direct(*direct_, values, lengths, weights);
  ScriptCall call(plain_execution_);
  try {
    auto inputs = script_inputs({values, lengths}, weights);
    if (lookup_unchecked_) return (*lookup_unchecked_)(std::move(inputs)).toTensor();
    return module_->forward(std::move(inputs)).toTensor();  // an artifact without the unchecked entry
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    rethrow_script_error(err);
  }
}

std::pair<at::Tensor, at::Tensor> Model::lookup_and_predict_unchecked(const at::Tensor& dense_features,
                                                                      const at::Tensor& values,
                                                                      const at::Tensor& lengths,
                                                                      const std::optional<at::Tensor>& weights) const {
  if (!has_dense()) throw RequestError(kNoDensePart);
  const int64_t batch = lengths.numel() / static_cast<int64_t>(features_.size());
  if (backend_ == Backend::Pt2) check_dense_program();
  validate_dense(dense_features, batch);
  try {
    if (backend_ == Backend::Pt2) {
      at::Tensor pooled = lookup_pt2(values, lengths, weights);
      if (batch == 0) return {pooled, at::empty({0}, at::TensorOptions().dtype(at::kFloat))};
      return {pooled, score_pt2(dense_features, pooled, batch)};
    }
    if (hot_) {  // PagedModel._scored: the pooled lookups through the cache, then the dense part
      at::Tensor pooled = lookup_cached(values, lengths, weights);
      return {pooled, score(dense_features, pooled, batch)};
    }
    read_ahead(values, lengths);
    const std::shared_ptr<const torch::jit::Method>& method =
        lookup_and_predict_unchecked_ ? lookup_and_predict_unchecked_ : lookup_and_predict_;
    if (!method)  // an artifact exported before lookup_and_predict: two forwards
      return {lookup_unchecked(values, lengths, weights), predict(dense_features, values, lengths, weights)};
    ScriptCall call(plain_execution_);
    auto pair = (*method)(script_inputs({dense_features, values, lengths}, weights)).toTuple();
    return {pair->elements()[0].toTensor(), scores_of(pair->elements()[1].toTensor(), batch, program_path_)};
  } catch (const Error&) {
    throw;
  } catch (const std::exception& err) {
    rethrow_script_error(err);
  }
}

}  // namespace embserve
