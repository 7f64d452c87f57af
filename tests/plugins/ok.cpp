// A minimal good plugin for the registry tests: node type `t_plugin_scale` (out = in * k).
#include "plugin_api.hpp"

namespace {
class Scale : public flowrun::Node {
  int64_t k_ = 1;

 public:
  void setup(flowrun::SetupContext& c) override { k_ = c.params().get<int64_t>("k"); }
  void run(flowrun::StepContext& c) override { c.out("out", c.in<int64_t>("in") * k_); }
};
}  // namespace

FLOWRUN_PLUGIN(reg) {
  reg.add(R"(type: t_plugin_scale
doc: "test plugin: out = in * k"
inputs: { in: { kind: value, type: int, doc: "a number" } }
outputs: { out: { kind: value, type: int, doc: "in * k" } }
params: { k: { type: int, default: 2, doc: "factor" } })",
          [] { return std::make_unique<Scale>(); }, FLOWRUN_PLUGIN_FILE);
}
