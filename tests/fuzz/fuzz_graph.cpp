// Graph files: parse (guarded YAML loading, substitution) and check against every built-in
// node schema. Any input must end in a GraphSpec or a GraphError with its diagnostics.
// Inputs that mention plugins are skipped: loading a plugin runs the library's code, and the
// fuzzer would be dlopen()ing whatever paths it invents.
#include <string>

#include "fuzz_util.hpp"
#include "spec.hpp"

using namespace flowrun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (text.find("plugin") != std::string::npos) return 0;
  const std::string path = fuzz::write("graph.yaml", text);
  try {
    GraphSpec g = load_graph(path, {}, fuzz::builtin_schemas());
    (void)to_yaml(resolved_config(g));  // a checked graph always prints
  } catch (const GraphError&) {
  }
  return 0;
}
