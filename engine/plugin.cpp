#include "plugin.hpp"

#include <dlfcn.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <set>
#include <stdexcept>

#include "plugin_api.hpp"

namespace flowrun {

namespace fs = std::filesystem;

static std::string g_current_plugin;
const std::string& current_plugin_file() { return g_current_plugin; }

void load_plugin(const std::string& path, Registry& reg) {
  static std::mutex mu;
  static std::set<std::string> loaded;
  std::lock_guard<std::mutex> lock(mu);
  const std::string what = "plugin " + path + ": ";
  std::error_code ec;
  if (!fs::exists(path, ec)) throw std::runtime_error(what + "no such file (paths in plugins: are relative to the graph file)");
  std::string key = fs::canonical(path, ec).string();
  if (loaded.count(key)) return;
  // RTLD_LOCAL: two plugins may use the same internal names; they see the engine's symbols
  // because they link against libflowrun_engine.so.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) throw std::runtime_error(what + "cannot load: " + dlerror());
  auto fn = reinterpret_cast<flowrun_plugin_fn>(dlsym(h, FLOWRUN_PLUGIN_ENTRY));
  if (!fn) {
    dlclose(h);
    throw std::runtime_error(what + "no entry point " FLOWRUN_PLUGIN_ENTRY "; define one with FLOWRUN_PLUGIN(reg) { ... }");
  }
  int plugin_abi = -1;
  g_current_plugin = path;
  int rc = 0;
  try {
    rc = fn(FLOWRUN_ABI_VERSION, &plugin_abi, &reg);
  } catch (const std::exception& e) {
    g_current_plugin.clear();
    throw std::runtime_error(what + "registration failed: " + e.what());
  }
  g_current_plugin.clear();
  if (rc != 0) {
    dlclose(h);
    throw std::runtime_error(what + "built for flowrun ABI " + std::to_string(plugin_abi) + ", this engine has ABI " +
                             std::to_string(FLOWRUN_ABI_VERSION) + "; rebuild the plugin against this engine");
  }
  loaded.insert(key);
  reg.note_plugin(path);
  spdlog::debug("loaded plugin {}", path);
  // The handle stays open for the life of the process: node objects hold its code.
}

std::vector<std::string> plugin_path_entries(const std::string& env) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= env.size()) {
    size_t end = env.find(':', start);
    if (end == std::string::npos) end = env.size();
    std::string e = env.substr(start, end - start);
    start = end + 1;
    if (e.empty()) continue;
    std::error_code ec;
    if (fs::is_directory(e, ec)) {
      std::vector<std::string> sos;
      for (const auto& f : fs::directory_iterator(e, ec))
        if (f.path().extension() == ".so") sos.push_back(f.path().string());
      std::sort(sos.begin(), sos.end());
      out.insert(out.end(), sos.begin(), sos.end());
    } else {
      out.push_back(e);
    }
  }
  return out;
}

}  // namespace flowrun
