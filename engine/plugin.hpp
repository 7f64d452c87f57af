// Loading plugins (shared libraries with node types; see plugin_api.hpp for writing one).
#pragma once
#include <string>
#include <vector>

namespace flowrun {

class Registry;

// dlopen PATH, check its ABI version and let it register its node types into `reg`.
// Loading the same file twice is a no-op. Throws std::runtime_error with a one-line
// message naming the file: missing file, not a shared library, missing entry point,
// ABI mismatch, or an exception from the plugin's registration.
void load_plugin(const std::string& path, Registry& reg);

// FLOWRUN_PLUGIN_PATH: ':'-separated files or folders (every *.so in a folder).
std::vector<std::string> plugin_path_entries(const std::string& env);

}  // namespace flowrun
