// Loading plugins: dlopen, the ABI check, registration; every failure a one-line error that
// names the plugin file and says what to do.
//
// Two failures happen inside dlopen itself, where the engine's code does not run:
//   - an undefined symbol: the plugin was built against other flowrun headers, or with the
//     other std::string ABI (_GLIBCXX_USE_CXX11_ABI=0: every flowrun function that takes a
//     std::string is then missing). dlerror() names the symbol; the error adds the fix.
//   - a static initializer (a global object's constructor) that throws. glibc's loader does
//     not pass the exception to dlopen's caller (measured with glibc 2.36, gcc 12 and clang:
//     std::terminate in the thread that called dlopen, whatever catch the caller has), so
//     while dlopen runs a terminate handler prints the plugin file and the exception before
//     the usual abort. The catch around dlopen stays for a loader that does pass it on. A
//     crash (a signal) in a static initializer is not caught: FLOWRUN_LOG=debug logs each
//     plugin file before dlopen opens it.
#include "plugin.hpp"

#include <cxxabi.h>
#include <dlfcn.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "plugin_api.hpp"

namespace flowrun {

namespace fs = std::filesystem;

static std::string g_current_plugin;
const std::string& current_plugin_file() { return g_current_plugin; }

namespace {

// The plugin dlopen is loading, for the terminate handler (set and read under load_plugin's
// lock, on the loading thread).
std::string g_opening;
std::thread::id g_opening_thread;
std::terminate_handler g_previous_terminate = nullptr;

[[noreturn]] void terminate_naming_plugin() {
  if (std::this_thread::get_id() == g_opening_thread && !g_opening.empty()) {
    std::string what = "an exception";
    if (std::exception_ptr e = std::current_exception()) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        what = std::string("an exception: ") + x.what();
      } catch (...) {
      }
    }
    std::fprintf(stderr,
                 "flowrun: plugin %s: a static initializer (the constructor of a global object) threw %s; the "
                 "library cannot be loaded and the process stops. Fix the plugin: do that work in FLOWRUN_PLUGIN(reg), "
                 "where an exception is reported as an error, or catch it in the constructor\n",
                 g_opening.c_str(), what.c_str());
    std::fflush(stderr);
  }
  if (g_previous_terminate) g_previous_terminate();
  std::abort();
}

// Names the plugin if std::terminate runs while dlopen runs its static initializers.
struct NamePluginOnTerminate {
  explicit NamePluginOnTerminate(const std::string& path) {
    g_opening = path;
    g_opening_thread = std::this_thread::get_id();
    g_previous_terminate = std::set_terminate(terminate_naming_plugin);
  }
  ~NamePluginOnTerminate() {
    std::set_terminate(g_previous_terminate);
    g_opening.clear();
  }
};

// dlerror()'s text plus, for an undefined symbol, what it means and how to fix it.
std::string explain_dlerror(const std::string& err) {
  const std::string marker = "undefined symbol: ";
  const size_t at = err.find(marker);
  if (at == std::string::npos) return err;
  std::string symbol = err.substr(at + marker.size());
  symbol = symbol.substr(0, symbol.find_first_of(" \t\n,"));
  std::string out = err;
  int status = 1;
  std::unique_ptr<char, void (*)(void*)> readable(abi::__cxa_demangle(symbol.c_str(), nullptr, nullptr, &status), std::free);
  if (status == 0 && readable) out += " (" + std::string(readable.get()) + ")";
  return out + "; the plugin needs a symbol this flowrun does not have: it was built against other flowrun headers, or "
               "with another C++ ABI (built with _GLIBCXX_USE_CXX11_ABI=0, it misses every flowrun function with a "
               "std::string in its signature). Rebuild it against this flowrun's headers (engine/plugin_api.hpp) with "
               "the same compiler and _GLIBCXX_USE_CXX11_ABI=" +
         std::to_string(_GLIBCXX_USE_CXX11_ABI) + ", as flowrun and libtorch are built";
}

}  // namespace

void load_plugin(const std::string& path, Registry& reg) {
  static std::mutex mu;
  static std::set<std::string> loaded;
  std::lock_guard<std::mutex> lock(mu);
  const std::string what = "plugin " + path + ": ";
  std::error_code ec;
  if (!fs::exists(path, ec)) throw std::runtime_error(what + "no such file (paths in plugins: are relative to the graph file)");
  std::string key = fs::canonical(path, ec).string();
  if (loaded.count(key)) return;
  spdlog::debug("loading plugin {}", path);  // before its static initializers run: a crash in one follows this line
  // RTLD_LOCAL: two plugins may use the same internal names; they see the engine's symbols
  // because they link against libflowrun_engine.so.
  void* h = nullptr;
  try {
    NamePluginOnTerminate name_it(path);
    h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  } catch (const std::exception& e) {
    throw std::runtime_error(what + "a static initializer (the constructor of a global object) threw: " + e.what() +
                             "; fix the plugin: do that work in FLOWRUN_PLUGIN(reg), or catch it in the constructor");
  }
  if (!h) {
    const char* err = dlerror();
    throw std::runtime_error(what + "cannot load: " + explain_dlerror(err ? err : "unknown dlopen error"));
  }
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
  } catch (...) {
    g_current_plugin.clear();
    throw std::runtime_error(what + "registration failed: it threw something that is not a std::exception");
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
