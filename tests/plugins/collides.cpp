// A plugin that registers `t_replaceable`, a type the test registered first (standing in for a
// built-in), with reg.add: refused, naming the type, both origins and the fix.
#include "plugin_api.hpp"

FLOWRUN_PLUGIN(reg) {
  reg.add("type: t_replaceable\ndoc: must never be registered\n", [] { return std::unique_ptr<flowrun::Node>(); },
          FLOWRUN_PLUGIN_FILE);
}
