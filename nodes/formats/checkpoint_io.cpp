#include "formats/checkpoint_io.hpp"

#include "formats/files.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace flowrun::ckpt {

namespace fs = std::filesystem;

std::string step_folder(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

void write_manifest(const std::string& folder, const Manifest& m) {
  nlohmann::json j;
  j["format"] = "flowrun-checkpoint";
  j["version"] = 1;
  j["step"] = m.step;
  j["graph"] = m.graph;
  j["name"] = m.name;
  j["states"] = m.states;
  j["rng"] = m.rng_file;
  j["config"] = m.config;
  write_file_atomic(folder + "/manifest.json", j.dump(2) + "\n");
}

// Field by field, each error naming the file and the field: a manifest is read before any
// state is, and a bad one must not become a negative step or a path outside the folder. A key
// given twice in one object is refused too (JSON parsers keep one of them silently).
Manifest read_manifest(const std::string& folder) {
  const std::string path = folder + "/manifest.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw std::runtime_error("checkpoint " + folder + " has no manifest.json (incomplete or not a checkpoint)");
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read it: " + std::strerror(errno));
  // nlohmann keeps the last of two equal keys: a manifest with "step" twice would pass the
  // field checks with whichever came last. The callback sees each key as it is read, by object,
  // and keeps only the open containers (their keys so far): the path of a duplicate is spelled
  // only when one is found, and nesting deeper than any manifest has is refused as it is read
  // (a file of a million '[' once built a string per level: 11.8 GB before any answer).
  constexpr size_t kMaxDepth = 64;
  struct Open {
    bool is_array;
    std::set<std::string> keys;
    std::string last_key;
  };
  std::vector<Open> open;
  std::string duplicate;  // the first one: "'step'" or "'m.p' in 'states'"
  const auto where = [&] {  // "states", "a.b", "list[]": the path of the innermost open object
    std::string path;
    for (size_t i = 0; i + 1 < open.size(); ++i)
      path += open[i].is_array ? "[]" : (path.empty() ? "" : ".") + open[i].last_key;
    return path;
  };
  const auto find_duplicates = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      if (open.size() == kMaxDepth)
        throw std::runtime_error(path + ": nested deeper than " + std::to_string(kMaxDepth) +
                                 " levels, which no manifest is; the checkpoint is damaged: resume from another one");
      open.push_back({event == E::array_start, {}, ""});
    } else if (event == E::object_end || event == E::array_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == E::key && !open.empty() && parsed.is_string()) {
      Open& o = open.back();
      o.last_key = parsed.get<std::string>();
      if (!o.keys.insert(o.last_key).second && duplicate.empty()) {
        const std::string in_path = where();
        duplicate = "'" + o.last_key + "'" + (in_path.empty() ? "" : " in '" + in_path + "'");
      }
    }
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in, find_duplicates);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(path + ": not valid JSON (byte " + std::to_string(e.byte) +
                             "); the checkpoint is damaged: resume from another one");
  } catch (const nlohmann::json::exception& e) {  // e.g. a number out of range (found by fuzz_manifest)
    throw std::runtime_error(path + ": not a valid manifest (" + e.what() +
                             "); the checkpoint is damaged: resume from another one");
  }
  if (!duplicate.empty())
    throw std::runtime_error(path + ": key " + duplicate +
                             " appears twice; flowrun writes each key once, so the manifest was damaged or edited: "
                             "remove one of them, or resume from another checkpoint");
  auto bad = [&](const std::string& field, const std::string& expected) {
    return std::runtime_error(path + ": field '" + field + "': expected " + expected +
                              (j.is_object() && j.contains(field) ? ", got " + j[field].dump() : ", but it is missing"));
  };
  if (!j.is_object()) throw std::runtime_error(path + ": expected a JSON object, got " + std::string(j.type_name()));
  if (!j.contains("format") || j["format"] != "flowrun-checkpoint") throw bad("format", "\"flowrun-checkpoint\"");
  if (!j.contains("version") || !j["version"].is_number_integer()) throw bad("version", "1");
  if (j["version"] != 1)
    throw std::runtime_error(path + ": manifest version " + j["version"].dump() + ", this flowrun reads version 1");
  Manifest m;
  if (!j.contains("step") || !j["step"].is_number_integer() || j["step"].get<int64_t>() < 1)
    throw bad("step", "the step number (an integer >= 1)");
  m.step = j["step"].get<int64_t>();
  auto text = [&](const char* field, std::string& out) {
    if (!j.contains(field)) return;
    if (!j[field].is_string()) throw bad(field, "a string");
    out = j[field].get<std::string>();
  };
  text("graph", m.graph);
  text("name", m.name);
  text("config", m.config);
  text("rng", m.rng_file);
  // A file of the checkpoint is a plain name inside its folder.
  auto plain = [](const std::string& f) { return !f.empty() && f.find('/') == std::string::npos && f != "." && f != ".."; };
  if (!m.rng_file.empty() && !plain(m.rng_file)) throw bad("rng", "a file name in the checkpoint folder");
  if (!j.contains("states") || !j["states"].is_object()) throw bad("states", "an object {state ref: file name}");
  for (const auto& [ref, file] : j["states"].items()) {
    if (!file.is_string() || !plain(file.get<std::string>()))
      throw std::runtime_error(path + ": field 'states." + ref + "': expected a file name in the checkpoint folder, got " +
                               file.dump());
    if (ref.find('.') == std::string::npos || ref.front() == '.' || ref.back() == '.')
      throw std::runtime_error(path + ": field 'states': '" + ref + "' is not a state ref NODE.PORT");
    m.states[ref] = file.get<std::string>();
  }
  return m;
}

std::string latest(const std::string& dir) { return read_latest(dir); }

std::vector<Found> checkpoints(const std::string& dir) {
  std::vector<Found> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step_", 0) != 0 || !e.is_directory(ec)) continue;
    Found f;
    f.folder = e.path().string();
    try {
      f.step = read_manifest(f.folder).step;
    } catch (const std::exception& x) {
      f.problem = x.what();
    }
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](const Found& a, const Found& b) {
    if (a.problem.empty() != b.problem.empty()) return a.problem.empty();  // complete ones first
    return a.step != b.step ? a.step > b.step : a.folder > b.folder;
  });
  return out;
}

void set_latest(const std::string& dir, const std::string& folder_name) {
  write_file_atomic(dir + "/latest", folder_name + "\n");
}

}  // namespace flowrun::ckpt
