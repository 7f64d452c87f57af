// Command-line overrides (KEY=VALUE, one per input line) applied to a real graph file,
// graphs/gpt.yaml, then checked: a bad override is a diagnostic, never a crash.
#include <spdlog/spdlog.h>

#include <sstream>
#include <string>
#include <vector>

#include "registry.hpp"
#include "spec.hpp"

using namespace flowrun;

namespace {
Registry& builtins() {
  static Registry* reg = [] {
    spdlog::set_level(spdlog::level::off);
    auto* r = new Registry;
    for (const std::string& t : builtin_types()) r->add(builtin_schema(t), nullptr, "built-in");
    return r;
  }();
  return *reg;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (text.find("plugin") != std::string::npos) return 0;  // see fuzz_graph.cpp
  std::vector<std::string> overrides;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) overrides.push_back(line);
  try {
    GraphSpec g = load_graph(FLOWRUN_SOURCE_DIR "/graphs/gpt.yaml", overrides, builtins());
    (void)to_yaml(resolved_config(g));
  } catch (const GraphError&) {
  }
  return 0;
}
