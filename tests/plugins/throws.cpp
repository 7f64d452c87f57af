// A plugin whose registration fails (a broken schema): the engine reports it with the file.
#include "plugin_api.hpp"

FLOWRUN_PLUGIN(reg) {
  reg.add("type: t_broken\nparams: { x: { type: floaty } }\n", [] { return std::unique_ptr<flowrun::Node>(); },
          FLOWRUN_PLUGIN_FILE);
}
