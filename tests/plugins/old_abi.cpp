// A plugin built with the old std::string ABI (_GLIBCXX_USE_CXX11_ABI=0, set by
// tests/CMakeLists.txt): Registry::add takes std::string, so its symbol is missing from the
// engine and dlopen fails with "undefined symbol"; the error must say how to rebuild it.
#include "plugin_api.hpp"

FLOWRUN_PLUGIN(reg) {
  reg.add("type: t_old_abi\ndoc: must never be registered\n", [] { return std::unique_ptr<flowrun::Node>(); },
          FLOWRUN_PLUGIN_FILE);
}
