// A plugin that replaces `t_replaceable` on purpose (reg.replace): it is replaced, with a warning
// naming the type and both origins.
#include "plugin_api.hpp"

namespace {
class Replacement : public flowrun::Node {
 public:
  void run(flowrun::StepContext&) override {}
};
}  // namespace

FLOWRUN_PLUGIN(reg) {
  reg.replace("type: t_replaceable\ndoc: \"test plugin: the replacement\"\n",
              [] { return std::make_unique<Replacement>(); }, FLOWRUN_PLUGIN_FILE);
}
