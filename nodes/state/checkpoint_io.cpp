#include "state/checkpoint_io.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace flowrun::ckpt {

namespace fs = std::filesystem;

std::string step_folder(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  ok = (::close(fd) == 0) && ok;
  if (!ok) throw std::runtime_error("writing " + tmp + " failed: " + std::strerror(errno));
  fs::rename(tmp, path);
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

Manifest read_manifest(const std::string& folder) {
  const std::string path = folder + "/manifest.json";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("checkpoint " + folder + " has no manifest.json (incomplete or not a checkpoint)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
    if (j.value("format", "") != "flowrun-checkpoint") throw std::runtime_error("not a flowrun checkpoint manifest");
    if (j.value("version", 0) != 1)
      throw std::runtime_error("manifest version " + std::to_string(j.value("version", 0)) + ", this flowrun reads 1");
    Manifest m;
    m.step = j.at("step").get<int64_t>();
    m.graph = j.value("graph", "");
    m.name = j.value("name", "");
    m.config = j.value("config", "");
    m.states = j.at("states").get<std::map<std::string, std::string>>();
    m.rng_file = j.value("rng", "");
    return m;
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
}

std::string latest(const std::string& dir) {
  std::ifstream in(dir + "/latest");
  std::string name;
  if (!in || !std::getline(in, name)) return "";
  return name;
}

void set_latest(const std::string& dir, const std::string& folder_name) {
  write_file_atomic(dir + "/latest", folder_name + "\n");
}

std::string resolve_latest(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path out;
  for (const auto& part : fs::path(path)) {
    if (part == "latest" && fs::is_regular_file(out / part)) {
      const std::string name = latest(out.string());
      if (!name.empty()) {
        out /= name;
        continue;
      }
    }
    out /= part;
  }
  return out.string();
}

}  // namespace flowrun::ckpt
