// Command-line overrides (KEY=VALUE, one per input line) applied to a real graph file,
// graphs/gpt.yaml, then checked: a bad override is a diagnostic, never a crash.
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_util.hpp"
#include "spec.hpp"

using namespace flowrun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (text.find("plugin") != std::string::npos) return 0;  // see fuzz_graph.cpp
  std::vector<std::string> overrides;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) overrides.push_back(line);
  try {
    GraphSpec g = load_graph(FLOWRUN_SOURCE_DIR "/graphs/gpt.yaml", overrides, fuzz::builtin_schemas());
    (void)to_yaml(resolved_config(g));
  } catch (const GraphError&) {
  }
  return 0;
}
