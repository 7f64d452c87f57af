// A plugin built for another engine ABI (FLOWRUN_PLUGIN_ABI=999 on the command line): the
// engine must refuse it, naming both versions, and register nothing.
#include <stdexcept>

#include "plugin_api.hpp"

FLOWRUN_PLUGIN(reg) {
  reg.add("type: t_bad_abi\ndoc: must never be registered\n",
          [] () -> std::unique_ptr<flowrun::Node> { throw std::logic_error("unreachable"); }, FLOWRUN_PLUGIN_FILE);
}
