// Strict JSON reading (formats/json_file.hpp).
#include "formats/json_file.hpp"

#include <cmath>
#include <filesystem>
#include <set>
#include <stdexcept>

#include "formats/files.hpp"

namespace flowrun {

namespace fs = std::filesystem;

nlohmann::json read_json_file(const std::string& path, uint64_t max_bytes) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!fs::exists(st)) throw std::runtime_error(path + ": no such file");
  if (fs::is_directory(st)) throw std::runtime_error(path + ": is a folder, not a JSON file");
  if (!fs::is_regular_file(st)) throw std::runtime_error(path + ": not a regular file (a device or a pipe?), so not a JSON file");
  const uint64_t size = fs::file_size(path, ec);
  if (!ec && size > max_bytes)
    throw std::runtime_error(path + ": " + std::to_string(size) + " bytes, more than the " + std::to_string(max_bytes) +
                             " such a file has; is it the right file?");
  std::string text;
  try {
    text = read_file(path);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(e.what());
  }
  return parse_json_strict(text, path);
}

nlohmann::json parse_json_strict(const std::string& text, const std::string& path) {
  // The callback sees each key as it is read and keeps only the open containers (their keys so
  // far): the path of a duplicate is spelled only when one is found, and nesting deeper than
  // the limit is refused as it is read (a file of a million '[' once built a string per level).
  struct Open {
    bool is_array;
    std::set<std::string> keys;
    std::string last_key;
  };
  std::vector<Open> open;
  std::string duplicate;  // the first one: "'step'" or "'m.p' in 'states'"
  const auto where = [&] {  // "states", "a.b", "list[]": the path of the innermost open object
    std::string p;
    for (size_t i = 0; i + 1 < open.size(); ++i) p += open[i].is_array ? "[]" : (p.empty() ? "" : ".") + open[i].last_key;
    return p;
  };
  const auto check = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      if (open.size() == kJsonMaxDepth)
        throw std::runtime_error(path + ": nested deeper than " + std::to_string(kJsonMaxDepth) + " levels");
      open.push_back({event == E::array_start, {}, ""});
    } else if (event == E::object_end || event == E::array_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == E::key && !open.empty() && parsed.is_string()) {
      Open& o = open.back();
      o.last_key = parsed.get<std::string>();
      if (!o.keys.insert(o.last_key).second && duplicate.empty()) {
        const std::string in = where();
        duplicate = "'" + o.last_key + "'" + (in.empty() ? "" : " in '" + in + "'");
      }
    }
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text, check);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(path + ": not valid JSON (byte " + std::to_string(e.byte) + ")");
  } catch (const nlohmann::json::exception& e) {  // e.g. a number out of range (found by fuzz_manifest)
    throw std::runtime_error(path + ": not valid JSON (" + e.what() + ")");
  }
  if (!duplicate.empty()) throw std::runtime_error(path + ": key " + duplicate + " appears twice");
  return j;
}

namespace {

std::string shown(const nlohmann::json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

[[noreturn]] void wrong(const std::string& where, const std::string& expected, const nlohmann::json& v) {
  throw std::runtime_error(where + ": expected " + expected + ", got " + shown(v));
}

}  // namespace

void json_as(const nlohmann::json& v, const std::string& where, int64_t& out) {
  constexpr double kLimit = 2147483648.0;  // 2^31
  const char* expected = "an integer between -2147483648 and 2147483647";
  double d = 0;
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() >= static_cast<uint64_t>(kLimit)) wrong(where, expected, v);
    out = static_cast<int64_t>(v.get<uint64_t>());
    return;
  }
  if (v.is_number_integer()) d = static_cast<double>(v.get<int64_t>());
  else if (v.is_number_float()) d = v.get<double>();
  else wrong(where, expected, v);
  if (!std::isfinite(d) || d != std::floor(d) || d < -kLimit || d >= kLimit) wrong(where, expected, v);
  out = static_cast<int64_t>(d);
}

void json_as(const nlohmann::json& v, const std::string& where, double& out) {
  if (!v.is_number() || !std::isfinite(v.get<double>())) wrong(where, "a finite number", v);
  out = v.get<double>();
}

void json_as(const nlohmann::json& v, const std::string& where, bool& out) {
  if (!v.is_boolean()) wrong(where, "true or false", v);
  out = v.get<bool>();
}

void json_as(const nlohmann::json& v, const std::string& where, std::string& out) {
  if (!v.is_string()) wrong(where, "a string", v);
  out = v.get<std::string>();
}

void json_as(const nlohmann::json& v, const std::string& where, std::vector<int64_t>& out) {
  if (!v.is_array()) wrong(where, "a list of integers", v);
  out.clear();
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t x = 0;
    json_as(v[i], where + "[" + std::to_string(i) + "]", x);
    out.push_back(x);
  }
}

void json_as(const nlohmann::json& v, const std::string& where, std::vector<std::string>& out) {
  if (!v.is_array()) wrong(where, "a list of strings", v);
  out.clear();
  for (size_t i = 0; i < v.size(); ++i) {
    std::string x;
    json_as(v[i], where + "[" + std::to_string(i) + "]", x);
    out.push_back(x);
  }
}

}  // namespace flowrun
