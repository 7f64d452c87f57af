// JSON files, read strictly: those other tools write (config.json, model_index.json, weight
// indexes, adapter_config.json, tokenizer_config.json) and flowrun's own (manifest.json).
//
//   nlohmann::json cfg = read_json_file(dir + "/config.json");
//   int64_t layers = json_value<int64_t>(cfg, dir + "/config.json", "num_layers", 28);
//
// read_json_file refuses, naming the file: what is not a regular file (a folder, /dev/zero), a
// file over max_bytes, JSON that does not parse, nests deeper than kJsonMaxDepth, or gives a key
// twice in one object (nlohmann keeps the last silently; the error says where the key is).
// json_value reads one key of an object as T or gives `fallback` when the key is missing or
// null, refusing a value of another type, naming file, key, the type expected and the value:
// an integer must be integral (32.7 is not 32) and within ±2^31 (no config key is larger; 1e30
// or 2^62 heads are damage), a float finite, a bool true or false ("yes" is not).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace flowrun {

inline constexpr size_t kJsonMaxDepth = 64;

nlohmann::json read_json_file(const std::string& path, uint64_t max_bytes = uint64_t{64} << 20);
// The same checks on text already read (`path` names it in errors).
nlohmann::json parse_json_strict(const std::string& text, const std::string& path);

// The checked conversions behind json_value (`where`: "FILE: key 'K'").
void json_as(const nlohmann::json& v, const std::string& where, int64_t& out);
void json_as(const nlohmann::json& v, const std::string& where, double& out);
void json_as(const nlohmann::json& v, const std::string& where, bool& out);
void json_as(const nlohmann::json& v, const std::string& where, std::string& out);
void json_as(const nlohmann::json& v, const std::string& where, std::vector<int64_t>& out);
void json_as(const nlohmann::json& v, const std::string& where, std::vector<std::string>& out);

template <class T>
T json_value(const nlohmann::json& obj, const std::string& file, const std::string& key, T fallback) {
  if (!obj.is_object()) return fallback;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  T out{};
  json_as(*it, file + ": key '" + key + "'", out);
  return out;
}

}  // namespace flowrun
