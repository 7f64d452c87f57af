#include "formats/checkpoint_io.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "formats/files.hpp"
#include "formats/json_file.hpp"

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
  if (m.world > 0) j["world"] = m.world;
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
  // JSON as read_json_file reads it: a key given twice is refused too (nlohmann keeps one of
  // them: a manifest with "step" twice would pass the field checks with whichever came last).
  nlohmann::json j;
  try {
    j = read_json_file(path);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string(e.what()) +
                             "; flowrun writes a manifest whole, so this one was damaged or edited: resume from another "
                             "checkpoint");
  }
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
  if (j.contains("world")) {
    if (!j["world"].is_number_integer() || j["world"].get<int64_t>() < 1 || j["world"].get<int64_t>() > (1 << 20))
      throw bad("world", "the number of processes that wrote it (an integer >= 1)");
    m.world = j["world"].get<int>();
  }
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
